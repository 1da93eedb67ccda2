"""Tiny random Hugging Face models built with transformers in the tests, a tokenizer to match,
and the exports several tests read.

Everything here is built offline on the CPU; sizes are small enough for a 2-core CI machine. The
suite runs in two processes (pytest-xdist, `bash run.sh test`): the tiny models and the shared
exports are made once, by whichever process asks first, in a folder both see, under a file lock.
A test that needs an export of its own makes it; one that only reads an export asks `exported`.
"""

from __future__ import annotations

import hashlib
import json
import os

# Two test processes share two cores: OpenMP teams of one each (before torch loads OpenMP), as
# a sweep gives the exports it runs at once, else the teams spin against each other
# (BENCHMARKS.md, sweep workers). A user's own setting stays.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

import edgellm  # noqa: E402
from edgellm.numerics import compare  # noqa: E402

SIZES = dict(max_seq_len=16, max_context_len=32)  # every tiny export's, unless a test says

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world from a tiny model",
          "edge devices run small language models", "one two three four five six seven"] * 20
PROMPT = "the quick brown fox jumps over the lazy"  # at least 8 tokens with this tokenizer
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'][0] }}:{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ bos_token }}a:"
                 "{% endif %}")  # short: a tiny export holds 32 positions


def make_tokenizer(folder):
    """A byte-level BPE tokenizer over ASCII only (no partial UTF-8 pieces), saved as
    tokenizer.json + tokenizer_config.json. Returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c.isascii()]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=160, special_tokens=[BOS, EOS], initial_alphabet=alphabet,
        limit_alphabet=len(alphabet)))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where transformers saves it
    return tok.get_vocab_size()


def tiny_lfm2_config(vocab, layers: int = 4):
    from transformers import Lfm2Config

    return Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      layer_types=["conv", "full_attention"] * (layers // 2),
                      max_position_embeddings=256, block_auto_adjust_ff_dim=False,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)


def tiny_llama_config(vocab):
    from transformers import LlamaConfig

    # Llama 3 rope scaling and untied embeddings: the paths SmolLM2 (tied, default rope) skips
    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=1, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})


def tiny_qwen3_config(vocab):
    from transformers import Qwen3Config

    # head_dim 32 over 4 heads of a 64-wide model: Qwen3's own head_dim, not hidden / heads
    return Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=1)


def tiny_qwen2_config(vocab):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=1)


WINDOW = 8  # every tiny sliding-window layer's: a 40-token run wraps each ring several times
LONG = dict(max_seq_len=16, max_context_len=48)  # sizes for runs past every window


def tiny_family_configs(vocab) -> dict:
    """{model_type: config} of the families beyond Llama, LFM2 and Qwen, each with what sets it
    apart switched on: windows of WINDOW, per-layer-type RoPE, Granite's multipliers, Gemma's
    soft cap and attention scale, Phi's partial rotary and LongRoPE past a short original
    context (32), SmolLM3's NoPE layer, Qwen3.5's DeltaNet layer beside a gated attention one."""
    from transformers import (Gemma3TextConfig, GraniteConfig, Lfm2MoeConfig, Lfm3Config,
                              MinistralConfig, MistralConfig, Olmo2Config, Phi3Config,
                              Qwen3_5TextConfig, Qwen3MoeConfig, SmolLM3Config)

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                  eos_token_id=1, pad_token_id=1)
    windows = dict(sliding_window=WINDOW)
    return {
        "lfm3": Lfm3Config(**common, **windows, num_hidden_layers=3, head_dim=16,
                           layer_types=["conv", "sliding_attention", "full_attention"]),
        "gemma3_text": Gemma3TextConfig(
            **{**common, "num_key_value_heads": 1}, **windows, num_hidden_layers=2, head_dim=16,
            query_pre_attn_scalar=24, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "mistral": MistralConfig(**common, **windows, num_hidden_layers=2),
        "ministral": MinistralConfig(**common, **windows, num_hidden_layers=2, head_dim=16,
                                     layer_types=["sliding_attention", "full_attention"]),
        "smollm3": SmolLM3Config(**common, num_hidden_layers=2, no_rope_layer_interval=2),
        "phi3": Phi3Config(
            **{**common, "max_position_embeddings": 64}, **windows, num_hidden_layers=2,
            original_max_position_embeddings=32,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                             "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0],
                             "original_max_position_embeddings": 32}),
        # weights of 0.1, not 0.02: with Granite 3's own multipliers (0.22, logits / 8) the
        # attention layers moved the logits by 6e-4, below the tolerance of the parity tests
        "granite": GraniteConfig(**common, num_hidden_layers=2, embedding_multiplier=4.0,
                                 residual_multiplier=0.5, attention_multiplier=0.3,
                                 logits_scaling=2.0, initializer_range=0.1),
        "olmo2": Olmo2Config(**common, num_hidden_layers=2),
        # two value heads per key head, partial rotary (a quarter of each head), the q gate
        "qwen3_5_text": Qwen3_5TextConfig(
            **common, num_hidden_layers=2, head_dim=16, linear_conv_kernel_dim=4,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"]),
        # 8 experts, 2 chosen: a dense leading layer, sigmoid scores with a bias and a routed
        # scale (LFM2-MoE); softmax scores left unnormalised and a dense layer amid the sparse
        # ones (Qwen3-MoE). Weights of 0.1 make the routers' choices clear-cut.
        "lfm2_moe": Lfm2MoeConfig(
            **common, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
            num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            routed_scaling_factor=2.5, initializer_range=0.1),
        "qwen3_moe": Qwen3MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False,
            initializer_range=0.1),
    }


FAMILIES = ("lfm3", "gemma3_text", "mistral", "ministral", "smollm3", "phi3", "granite", "olmo2",
            "qwen3_5_text", "lfm2_moe", "qwen3_moe")


def q4_k_blocks(shape, seed=0):
    """(raw GGUF Q4_K bytes (rows, bytes per row), what gguf's own dequantizer reads from them):
    random blocks, fp16 scale and minimum per 256 weights, random 6-bit sub-block scales and
    minimums and random codes (gguf has no Q4_K quantizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    rows, supers = shape[0], shape[1] // 256
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for at in (0, 2):  # d, then dmin
        scale = (rng.random((rows, supers)) * 0.002 + 0.0005).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, supers, 2)
    raw = raw.reshape(rows, -1)
    return raw, torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).copy())


def random_model(config):
    """transformers' model of `config`, seed 0, with random norms and biases beyond LFM2 and
    Llama: what transformers initializes to ones (or zeros) would hide them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if config.model_type not in ("lfm2", "llama"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.3 * torch.randn(p.shape))  # Gemma's are w - 1, from zeros
                elif name.endswith(".bias"):
                    p.copy_(0.5 * torch.randn(p.shape))
            for name, b in model.named_buffers():  # LFM2-MoE's: zeros would hide what it picks
                if name.endswith("expert_bias"):
                    b.copy_(0.05 * torch.randn(b.shape))
    return model


def save_model(config, folder):
    model = random_model(config)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return model


def pytest_collection_modifyitems(items):
    """Tests marked `heavy` (a real-size model) first: in two processes, a long test at the end
    of the list would run alone."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """A folder every test process of this run sees (pytest-xdist's workers share the parent of
    their base temporary folders)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


def made_once(path, make) -> None:
    """Run make() unless `path` was made already, by this process or another."""
    with FileLock(f"{path}.lock"):
        if not (path / ".done").exists():
            make()
            (path / ".done").write_text("")


@pytest.fixture(scope="session")
def tiny_models(shared_dir):
    """{arch: (folder, transformers model)} for a mixed conv/attention LFM2, a Llama, a Qwen2,
    a Qwen3 and each of FAMILIES."""
    from transformers import AutoModelForCausalLM

    root = shared_dir / "models"
    makers = (("lfm2", tiny_lfm2_config), ("llama", tiny_llama_config),
              ("qwen2", tiny_qwen2_config), ("qwen3", tiny_qwen3_config),
              *((name, lambda vocab, name=name: tiny_family_configs(vocab)[name])
                for name in FAMILIES))

    def make():
        vocab = make_tokenizer(root / "tok")
        for arch, config in makers:
            save_model(config(vocab), root / arch)
        save_model(tiny_lfm2_config(vocab, layers=2), root / "lfm2-2")  # small_lfm2

    root.mkdir(exist_ok=True)
    made_once(root, make)
    return {arch: (root / arch, AutoModelForCausalLM.from_pretrained(root / arch).eval())
            for arch, _ in makers}


@pytest.fixture(scope="session")
def small_lfm2(tiny_models):
    """The folder of a 2-layer LFM2 (a conv and an attention layer), made with the tiny models:
    for tests that export without the patches, where every layer costs."""
    return tiny_models["lfm2"][0].parent / "lfm2-2"


@pytest.fixture(scope="session")
def exported(tiny_models, shared_dir):
    """exported(arch, **options) -> (folder, report): a tiny model's export (XNNPACK, SIZES,
    verified, with an ETRecord unless the options say otherwise), made once for every test
    that asks for the same options. Read it; never write into its folder."""
    def export(arch: str, **options):
        options = {"backends": "xnnpack", "etrecord": True, **SIZES, **options}
        key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
        folder = shared_dir / "exports" / f"{arch}-{key}"
        folder.parent.mkdir(exist_ok=True)
        made_once(folder, lambda: edgellm.export(tiny_models[arch][0], output=folder,
                                                 force=True, quiet=True, **options))
        return folder, json.loads((folder / "report.json").read_text())
    return export


@pytest.fixture(scope="session")
def default_export(shared_dir):
    """(folder, report) of the embedded default, SmolLM2-135M-Instruct, exported to XNNPACK and
    verified: once for every test process."""
    folder = shared_dir / "default" / "smollm2"
    folder.parent.mkdir(exist_ok=True)
    made_once(folder, lambda: edgellm.export(output=folder, backends="xnnpack", max_seq_len=64,
                                             force=True, quiet=True))
    return folder, json.loads((folder / "report.json").read_text())


@pytest.fixture(scope="session")
def prompt_ids(tiny_models):
    from tokenizers import Tokenizer

    folder = next(iter(tiny_models.values()))[0]
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    assert len(ids) >= 8
    return ids


def reference_run(hf_model, prompt, steps=8):
    """transformers without a cache: the full sequence each step. Returns (greedy tokens, logits of
    the last position after the prompt and after each generated token but the last)."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = hf_model(torch.tensor([ids])).logits[0, -1]
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt):], torch.stack(logits)


def cached_run(forward, prompt, tokens):
    """Prefill `prompt` in one call, then feed `tokens` (the reference's) one per call.
    Returns the logits of every step, shaped like reference_run's."""
    out = [forward(torch.tensor([prompt]), torch.tensor([0]))[0]]
    for i, tok in enumerate(tokens[:-1]):
        out.append(forward(torch.tensor([[tok]]), torch.tensor([len(prompt) + i]))[0])
    return torch.stack(out)


def cached_run_one_by_one(forward, prompt, tokens):
    """Like cached_run for programs that take one token per call (static shapes)."""
    for i, tok in enumerate(prompt):
        last = forward(torch.tensor([[tok]]), torch.tensor([i]))[0]
    out = [last]
    for i, tok in enumerate(tokens[:-1]):
        out.append(forward(torch.tensor([[tok]]), torch.tensor([len(prompt) + i]))[0])
    return torch.stack(out)


def assert_logits_close(actual, expected, atol, what=""):
    """Logits within `atol` and the same greedy token at every step; reports the figures."""
    c = compare(actual, expected)
    assert c.max_abs <= atol and c.argmax_agree == 1.0, f"{what}: {c} (tolerance {atol})"
    return c
