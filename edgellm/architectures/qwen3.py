"""Qwen3 dense models (transformers `model_type: qwen3`): Llama's layout (llama.py) with an
RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`) and a
head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024).

Sliding-window layers (`use_sliding_window`, which the released Qwen3 checkpoints leave off) are
refused: the static KV cache here keeps every position (llama.sliding_layers).
"""

from __future__ import annotations

from . import llama


check = llama.check


def unsupported(cfg) -> list[str]:
    return llama.sliding_layers(cfg, "Qwen3")


def build(cfg, opts, dtype):
    return llama.build(cfg, opts, dtype, llama.Variant(qk_norm=True))
