"""Where weights come from: Hugging Face folders (single file or shards) and their refusals, and a
GGUF written here from a tiny model."""

import json
import math
import shutil

import pytest
import torch

from edgellm.errors import InputError
from edgellm.sources import load_source


def test_sharded_folder_loads_the_same_tensors(tiny_models, tmp_path):
    folder, hf = tiny_models["lfm2"]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, many = load_source(str(folder)), load_source(str(tmp_path / "sharded"))
    assert sorted(one.state_dict) == sorted(many.state_dict)
    assert all(torch.equal(one.state_dict[k], many.state_dict[k]) for k in one.state_dict)
    assert (one.bos_id, one.eos_ids) == (0, (1,))


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(InputError, match=r"has no config\.json"):
        load_source(str(tmp_path / "m"))


def test_folder_without_weights(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    (tmp_path / "m").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "m")
    with pytest.raises(InputError, match=r"has no \*\.safetensors weights"):
        load_source(str(tmp_path / "m"))


def test_truncated_safetensors(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    shutil.copytree(folder, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"model\.safetensors is not a readable safetensors file"):
        load_source(str(tmp_path / "m"))


def test_index_naming_a_missing_shard(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(InputError, match="lists shards that are missing: model-00001-of-00002"):
        load_source(str(tmp_path / "m"))


LLAMACPP_ARCH = {"gemma3_text": "gemma3", "mistral": "llama", "lfm2_moe": "lfm2moe",
                 "qwen3_moe": "qwen3moe"}  # model_type -> GGUF arch
PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's LlamaModel and its subclasses


def write_gguf(hf, tokenizer_json, path, quantized: dict | None = None,
               eot: int | None = None, chat_template: str | None = None,
               pre: str = "qwen2") -> None:
    """A tiny model as llama.cpp's converter (conversion/*.py) writes it: tensors under gguf's
    names (`quantized`: HF name -> (raw bytes, GGML type) to store instead of F32), q and k rows
    permuted for the llama-derived families, Gemma's norms as 1 + w, LFM2's kernels squeezed,
    Llama 3's and Phi-3's RoPE factors as tensors, experts stacked per layer as
    `ffn_{gate,up,down}_exps` and LFM2-MoE's expert bias as `exp_probs_b.bias`; each family's
    metadata keys; the byte-level BPE tokenizer as a gpt2 vocabulary with merges, split as
    llama.cpp's pre-tokenizer `pre` splits."""
    import gguf
    import numpy as np

    from edgellm.architectures.llama import head_dim

    cfg, tok = hf.config, json.loads(tokenizer_json.read_text())
    arch = LLAMACPP_ARCH.get(cfg.model_type, cfg.model_type)
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Mistral 7B" if cfg.model_type == "mistral" else cfg.model_type)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps)
    if arch in ("lfm2", "lfm2moe"):
        w.add_head_count_kv([kv if t == "full_attention" else 0 for t in cfg.layer_types])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    else:
        w.add_head_count_kv(kv)
    if arch in ("lfm2moe", "qwen3moe"):  # LFM2MoeModel's and Qwen2MoeModel's keys
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "lfm2moe":
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        if rope["full_attention"]["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":  # no key length; the rotated width; LongRoPE's original context
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // heads)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(0)
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    vocab = dict(tok["model"]["vocab"]) | {t["content"]: t["id"] for t in tok["added_tokens"]}
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(vocab))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if eot is not None:  # end of turn (a chat model's <|im_end|>, <|eot_id|>)
        w.add_eot_token_id(eot)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(kind, cfg.num_hidden_layers)
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        rope_factors = []
        inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        low = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
        high = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
        for freq in inv.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high:
                rope_factors.append(1.0)
            elif wavelen > low:
                rope_factors.append(rope["factor"])
            else:
                smooth = (rope["original_max_position_embeddings"] / wavelen
                          - rope["low_freq_factor"]) / (rope["high_freq_factor"]
                                                        - rope["low_freq_factor"])
                rope_factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.array(rope_factors, dtype=np.float32))
    if rope.get("rope_type") == "longrope":
        for which in ("long", "short"):
            w.add_tensor(f"rope_factors_{which}.weight",
                         np.array(rope[f"{which}_factor"], dtype=np.float32))
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        raw, kind = (quantized or {}).get(name, (tensor.detach().float().numpy(), None))
        base, leaf = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{leaf}"
        if name.endswith("experts.gate_up_proj"):  # (E, 2F, D): gate and up apart
            down = names.get_name(name.replace("gate_up_proj", "down_proj"))
            half = raw.shape[1] // 2
            for part, rows in (("gate", raw[:, :half]), ("up", raw[:, half:])):
                w.add_tensor(f"{down.replace('down', part)}.weight", np.ascontiguousarray(rows))
            continue
        if name.endswith(("experts.down_proj", "expert_bias")):
            gguf_name = names.get_name(name) + (".bias" if leaf == "expert_bias" else ".weight")
        if kind is None:
            if arch in PERMUTED and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
                n = heads if gguf_name.split(".")[-2] == "attn_q" else kv
                raw = raw.reshape(n, 2, raw.shape[0] // n // 2, *raw.shape[1:]) \
                    .swapaxes(1, 2).reshape(raw.shape)
            if arch == "gemma3" and name.endswith("norm.weight"):
                raw = raw + 1
            if arch in ("lfm2", "lfm2moe") and name.endswith("conv.conv.weight"):
                raw = raw.squeeze(1)
        w.add_tensor(gguf_name, np.ascontiguousarray(raw), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_configs(vocab) -> dict:
    """{model_type: tiny config} of each family as much as a GGUF can say of it: llama.cpp keeps
    Gemma 3's five local layers to a global one and its q scale of 1/sqrt(head_dim) in code, and
    SmolLM3's NoPE on every fourth layer; it runs Phi-3 without a window and writes Mistral as
    Llama (no window either)."""
    from transformers import Gemma3TextConfig, MistralConfig, SmolLM3Config

    from conftest import (WINDOW, tiny_family_configs, tiny_lfm2_config, tiny_llama_config,
                          tiny_qwen2_config, tiny_qwen3_config)

    family = tiny_family_configs(vocab)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
                  eos_token_id=1, pad_token_id=1)
    phi3 = family["phi3"]
    phi3.sliding_window = None
    return {
        "llama": tiny_llama_config(vocab), "lfm2": tiny_lfm2_config(vocab),
        "qwen2": tiny_qwen2_config(vocab),
        "qwen3": tiny_qwen3_config(vocab),
        "mistral": MistralConfig(**common, num_hidden_layers=2, sliding_window=None),
        "gemma3_text": Gemma3TextConfig(
            **{**common, "num_key_value_heads": 1}, sliding_window=WINDOW, num_hidden_layers=6,
            head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
            rope_parameters=family["gemma3_text"].rope_parameters),
        "phi3": phi3, "granite": family["granite"], "olmo2": family["olmo2"],
        "smollm3": SmolLM3Config(**common, num_hidden_layers=4, no_rope_layer_interval=4),
        # llama.cpp's LFM2-MoE graph normalises the chosen weights and does not scale them, and
        # its Qwen3-MoE has every layer sparse, normalised
        "lfm2_moe": family["lfm2_moe"].__class__(**{
            **family["lfm2_moe"].to_dict(), "routed_scaling_factor": 1.0}),
        "qwen3_moe": family["qwen3_moe"].__class__(**{
            **family["qwen3_moe"].to_dict(), "mlp_only_layers": [], "norm_topk_prob": True}),
    }


def fixture_config(family: str, vocab: int):
    """gguf_configs' tiny config of `family` widened as tests/data/gguf holds it
    (bench/gguf_fixtures.py): rows of 256 (the K-quants' super block) in the attention, up/gate
    projections and tables, of 320 (a multiple of 32, not of 256) in the down projections; heads
    of 64."""
    cfg = gguf_configs(vocab)[family]
    cfg.hidden_size, cfg.intermediate_size = 256, 320
    if getattr(cfg, "head_dim", None):
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if getattr(cfg, "moe_intermediate_size", None):
        cfg.moe_intermediate_size = 64
    if getattr(cfg, "query_pre_attn_scalar", None):
        cfg.query_pre_attn_scalar = cfg.head_dim
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "short_factor" in rope:  # LongRoPE: a factor per rotated pair
        pairs = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size
                    // cfg.num_attention_heads) // 2
        for which in ("short_factor", "long_factor"):
            rope[which] = [rope[which][i * len(rope[which]) // pairs] for i in range(pairs)]
    return cfg


@pytest.mark.parametrize("family", ["llama", "lfm2", "mistral", "gemma3_text", "phi3",
                                    "granite", "olmo2", "smollm3", "lfm2_moe", "qwen3_moe"])
def test_a_family_gguf_matches_transformers(tiny_models, prompt_ids, tmp_path, family):
    """A GGUF in llama.cpp's layout (write_gguf) reads back as the model transformers runs: a
    prompt, then one token per call past Gemma 3's window, logits within the fp32 tolerance and
    the same greedy tokens. Wrong q/k order, a norm off by one, a lost LongRoPE factor, partial
    rotary, Llama 3's frequency scaling, Granite's multipliers or a NoPE layer would each move
    the logits."""
    from conftest import assert_logits_close, cached_run, random_model, reference_run
    from edgellm.architectures import build_model
    from edgellm.architectures.layers import ModelOptions

    folder = tiny_models["qwen3"][0]
    cfg = gguf_configs(tiny_models["qwen3"][1].config.vocab_size)[family]
    hf = random_model(cfg)
    gguf_file = tmp_path / f"tiny-{family}.gguf"
    write_gguf(hf, folder / "tokenizer.json", gguf_file)
    source = load_source(str(gguf_file))
    assert source.hf_config.model_type == ("llama" if family == "mistral" else family)
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    tokens, expected = reference_run(hf, prompt_ids, steps=6)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=f"{family} from GGUF")


def test_a_gguf_s_experts_are_read_an_expert_at_a_time(tiny_models, tmp_path, monkeypatch):
    """llama.cpp stacks each layer's experts (`ffn_{gate,up,down}_exps`, E x rows); loading the
    file reads none of them, and each expert read later is its own slice of the mapped file,
    dequantized (here a Q8_0 down_proj): equal to gguf's dequantization of the whole tensor, and
    gate then up for transformers' gate_up_proj."""
    import gguf

    import edgellm.sources.gguf as reader
    from conftest import random_model
    from edgellm.architectures.moe import Deferred

    folder, vocab = tiny_models["qwen3"][0], tiny_models["qwen3"][1].config.vocab_size
    hf = random_model(gguf_configs(vocab)["qwen3_moe"])
    down, gate_up = (f"model.layers.2.mlp.experts.{n}" for n in ("down_proj", "gate_up_proj"))
    q8 = gguf.quants.quantize(hf.state_dict()[down].float().numpy(),
                              gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "moe.gguf"
    write_gguf(hf, folder / "tokenizer.json", path,
               quantized={down: (q8, gguf.GGMLQuantizationType.Q8_0)})
    reads, read = [], reader._expert_values
    monkeypatch.setattr(reader, "_expert_values", lambda *a: reads.append(a[-2:]) or read(*a))
    source = load_source(str(path))
    assert reads == [] and all(isinstance(source.state_dict[n], Deferred) for n in (down, gate_up))
    whole = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    stack = source.state_dict[down]
    assert stack.shape == (8, 64, 32) and torch.equal(stack[5], torch.from_numpy(whole[5]))
    assert reads == [("blk.2.ffn_down_exps.weight", 5)]
    assert torch.equal(stack.to(torch.float32), torch.from_numpy(whole))
    assert torch.equal(source.state_dict[gate_up][3], hf.state_dict()[gate_up][3].float())


@pytest.mark.parametrize("arch, width", [("qwen2", 16), ("qwen3", 32)])
def test_qwen_gguf_loads_and_matches_transformers(tiny_models, prompt_ids, tmp_path, arch,
                                                  width):
    """The model read from a GGUF matches transformers, and its tokenizer (the one verification
    reads and the tokenizer.json that ships) encodes as the model's own. Qwen3's head width (32,
    not hidden / heads and not Qwen3Config's default 128) comes from the file's
    attention.key_length, which transformers' GGUF config map leaves out; Qwen2's q/k/v biases
    come through as GGUF `.bias` tensors. The XNNPACK program from a GGUF: the Q4_K test below."""
    from tokenizers import Tokenizer

    from conftest import PROMPT, assert_logits_close, cached_run, reference_run
    from edgellm.architectures import build_model
    from edgellm.architectures.layers import ModelOptions
    from edgellm.architectures.llama import head_dim

    folder, hf = tiny_models[arch]
    gguf_file = tmp_path / f"tiny-{arch}-F32.gguf"
    write_gguf(hf, folder / "tokenizer.json", gguf_file)
    source = load_source(str(gguf_file))
    assert (source.hf_config.model_type, head_dim(source.hf_config)) == (arch, width)
    assert (source.bos_id, source.eos_ids) == (0, (1,))
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    tokens, expected = reference_run(hf, prompt_ids, steps=4)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=f"{arch} from GGUF")
    assert source.write_tokenizer(tmp_path)
    own = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(PROMPT).ids == own
    assert source.tokenizer().encode(PROMPT).ids == own


def test_a_q4_k_gguf_keeps_its_grid_through_export(tiny_models, prompt_ids, tmp_path):
    """A K-quant file's Q4_K linears (here every one, in a 256-wide Qwen3: Q4_K's super-blocks)
    come through transformers' GGUF loader with their storage type, and `8da4w` keeps each on the
    file's grid; the program matches transformers on the file's weights within 8-bit dynamic
    activations (verify's bounds)."""
    from gguf import GGMLQuantizationType
    from transformers import AutoModelForCausalLM, Qwen3Config

    import edgellm
    from conftest import q4_k_blocks

    folder = tiny_models["qwen3"][0]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=tiny_models["qwen3"][1].config.vocab_size, hidden_size=256,
        intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1)).eval()
    quantized = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(hf.named_parameters()):
            if name.startswith("model.layers.") and p.dim() == 2:
                raw, weight = q4_k_blocks(tuple(p.shape), seed=i)
                p.copy_(weight)
                quantized[name] = (raw, GGMLQuantizationType.Q4_K)
    gguf_file = tmp_path / "tiny-qwen3-Q4_K.gguf"
    write_gguf(hf, folder / "tokenizer.json", gguf_file, quantized)
    stored = load_source(str(gguf_file)).stored_types
    assert stored["model.layers.0.mlp.down_proj.weight"] == "Q4_K" and len(quantized) == 7
    report = edgellm.export(gguf_file, output=tmp_path / "o", backends="xnnpack",
                            quantize="8da4w", max_seq_len=16, max_context_len=32, quiet=True)
    q = report["quantization"]
    assert (q["group_size"], q["linears_on_source_grid"], q["linears_at_8_bits"]) == \
        (32, 7, ["lm_head"])  # the F32 table the head is tied to: above 4 bits, so 8
    assert report["verify"]["passed"] and report["files"]["tokenizer"] == "tokenizer.json"


@pytest.mark.parametrize("arch, message", [
    ("gemma3n", r"Unsupported model_type 'gemma3n' \(Gemma 3n .*\)\. Supported: lfm2, lfm3"),
    ("qwen35moe", r"Unsupported model_type 'qwen3_5_moe'\. Supported:"),
    ("lfm3", r"holds a 'lfm3' model, which edgellm exports from its Hugging Face folder, not "
             r"from a GGUF file; it reads GGUF files of lfm2, llama, smollm3, qwen2, qwen3, "
             r"gemma3, phi3, granite, olmo2, lfm2moe, qwen3moe \(llama\.cpp's names\)\.$"),
    ("bert", r"Unsupported model_type 'bert'\. Supported: lfm2, lfm3"),
])
def test_a_gguf_of_another_family_is_refused_by_name(tmp_path, arch, message):
    """Refused from the file's metadata alone, before any config or weight is read."""
    import gguf

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match=message):
        load_source(str(path))


def test_a_gguf_ships_its_chat_template_and_stops_at_the_end_of_a_turn(tiny_models, tmp_path):
    """`tokenizer.chat_template` comes out beside the program (transformers' conversion writes
    it), and the end-of-turn id joins the end-of-sequence one among the program's stops."""
    from conftest import CHAT_TEMPLATE

    folder, hf = tiny_models["llama"]
    gguf_file = tmp_path / "chat.gguf"
    write_gguf(hf, folder / "tokenizer.json", gguf_file, eot=0, chat_template=CHAT_TEMPLATE)
    source = load_source(str(gguf_file))
    assert source.eos_ids == (1, 0)
    assert source.write_tokenizer(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE


@pytest.mark.parametrize("kind, rows, cols", [
    ("Q4_0", 3, 64), ("Q4_1", 300, 4096), ("Q8_0", 5000, 256), ("Q4_K", 70, 512),
    ("Q6_K", 9, 256), ("Q5_1", 1, 96)])
def test_gguf_dequantization_gives_ggufs_own_floats(monkeypatch, kind, rows, cols):
    """edgellm dequantizes with each type's own `dequantize_rows` in chunks: the
    same floats as `gguf.quants.dequantize`, for one chunk, many (Q4_1 and Q8_0 here span
    several at a chunk of 2^16 values) and a part-filled last one."""
    import gguf
    import numpy as np

    from edgellm.sources import gguf as reader

    qtype = gguf.GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    if kind in ("Q4_K", "Q6_K"):  # gguf's Python quantizer lacks the k-quants: random bytes
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = np.random.default_rng(1).integers(0, 256, (rows, cols // block * size), np.uint8)
        data.reshape(-1, size)[:, :2] = np.array([0.01], np.float16).view(np.uint8)  # scale d
    else:
        data = gguf.quants.quantize(values, qtype)
    monkeypatch.setattr(reader, "DEQUANTIZE_CHUNK", 1 << 16)  # several chunks, a last short one
    ours, theirs = reader._dequantize(data, qtype), gguf.quants.dequantize(data, qtype)
    assert ours.shape == theirs.shape == (rows, cols)
    assert np.array_equal(ours, theirs, equal_nan=True)
