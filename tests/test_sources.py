"""Where weights come from: Hugging Face folders (single file or shards) and their refusals, and a
GGUF written here from a tiny model."""

import json
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


# HF module -> GGUF tensor, inside "model.layers.N." / "blk.N." (llama.cpp's names for qwen2/3)
GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_qwen_gguf(hf, tokenizer_json, path, quantized: dict | None = None) -> None:
    """A tiny Qwen2 or Qwen3 as llama.cpp's converter lays it out: F32 tensors under GGUF names
    (`quantized`: HF name -> (raw bytes, GGML type) to store instead), the architecture's
    metadata, and its byte-level BPE tokenizer as a gpt2 vocabulary with merges."""
    import gguf

    from edgellm.architectures.llama import head_dim

    cfg, tok = hf.config, json.loads(tokenizer_json.read_text())
    w = gguf.GGUFWriter(str(path), cfg.model_type)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim(cfg))
    w.add_value_length(head_dim(cfg))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = dict(tok["model"]["vocab"]) | {t["content"]: t["id"] for t in tok["added_tokens"]}
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(vocab))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        raw, kind = (quantized or {}).get(name, (tensor.detach().float().numpy(), None))
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            name = f"blk.{layer}.{GGUF_LAYER[module]}.{leaf}"
        else:
            name = GGUF_TOP[name]
        w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    write_qwen_gguf(hf, folder / "tokenizer.json", gguf_file)
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
    write_qwen_gguf(hf, folder / "tokenizer.json", gguf_file, quantized)
    stored = load_source(str(gguf_file)).stored_types
    assert stored["model.layers.0.mlp.down_proj.weight"] == "Q4_K" and len(quantized) == 7
    report = edgellm.export(gguf_file, output=tmp_path / "o", backends="xnnpack",
                            quantize="8da4w", max_seq_len=16, max_context_len=32, quiet=True)
    q = report["quantization"]
    assert (q["group_size"], q["linears_on_source_grid"], q["linears_at_8_bits"]) == \
        (32, 7, ["lm_head"])  # the F32 table the head is tied to: above 4 bits, so 8
    assert report["verify"]["passed"] and report["files"]["tokenizer"] == "tokenizer.json"
