"""Qwen3 dense models (transformers `model_type: qwen3`): Llama's layout (llama.py) with an
RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`) and a
head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024, not 64).

Sliding-window layers (`use_sliding_window`, which the released Qwen3 checkpoints leave off) keep
ring buffers (llama.layer_windows).
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout


def _params_problems(p: dict, model_class: str) -> list[str]:
    out = llama.attention_only(p)
    if not (p["use_hf_rope"] and p["use_qk_norm"] and p["qk_norm_before_rope"]):
        out.append("use_hf_rope, use_qk_norm and qk_norm_before_rope must all be true, as in "
                   "ExecuTorch's qwen3 configs (Qwen3 normalises each q and k head before "
                   "half-split RoPE)")
    if p["use_scaled_rope"]:
        out.append(llama.UNSCALED_ROPE)
    return out


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import Qwen3Config

    return Qwen3Config(**common, rms_norm_eps=p["norm_eps"], head_dim=p["head_dim"],
                       rope_parameters=llama.default_rope(p), tie_word_embeddings=tied,
                       attention_bias=False)


ARCHITECTURE = llama.relative(
    "qwen3", "Qwen3 dense models (Llama layout with per-head q and k norms)",
    llama.Variant(qk_norm="head"), "Qwen3", gguf=GgufLayout("qwen3"), executorch=llama.meta_layout(
        ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b"),
        {"attention.q_norm_fn.weight": "self_attn.q_norm.weight",
         "attention.k_norm_fn.weight": "self_attn.k_norm.weight"}, _params_problems, _config))
