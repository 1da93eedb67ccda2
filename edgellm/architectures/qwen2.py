"""Qwen2 and Qwen2.5 (transformers `model_type: qwen2`): Llama's layout (llama.py) with biases on
the q, k and v projections (o has none). Sliding-window layers keep ring buffers, as for Qwen3.
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout


def _params_problems(p: dict, model_class: str) -> list[str]:
    out = llama.attention_only(p)
    if not (p["use_hf_rope"] and p["attention_qkv_bias"]) or p["use_qk_norm"]:
        out.append("use_hf_rope and attention_qkv_bias must be true and use_qk_norm false, as in "
                   "ExecuTorch's qwen2_5 configs (Qwen2 has biases on q, k and v and no q/k "
                   "norms)")
    if p["head_dim"] * p["n_heads"] != p["dim"]:
        out.append(f"head_dim {p['head_dim']} must be dim / n_heads = {p['dim'] / p['n_heads']}")
    if p["use_scaled_rope"]:
        out.append(llama.UNSCALED_ROPE)
    return out


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import Qwen2Config

    return Qwen2Config(**common, rms_norm_eps=p["norm_eps"], rope_parameters=llama.default_rope(p),
                       tie_word_embeddings=tied)


ARCHITECTURE = llama.relative(
    "qwen2", "Qwen2 and Qwen2.5 (Llama layout with q, k and v biases)",
    llama.Variant(qkv_bias=True), "Qwen2", executorch=llama.meta_layout(
        ("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_coder_32b"),
        {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}, _params_problems,
        _config, qkv_bias=True), gguf=GgufLayout("qwen2"))
