"""Qwen3 dense models (transformers `model_type: qwen3`): Llama's layout (llama.py) with an
RMSNorm over each head of q and k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`) and a
head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024).

Sliding-window layers (`use_sliding_window`, which the released Qwen3 checkpoints leave off) are
refused: the static KV cache here keeps every position.
"""

from __future__ import annotations

from . import llama


check = llama.check


def unsupported(cfg) -> list[str]:
    sliding = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or [])
               if kind != "full_attention"]
    if getattr(cfg, "use_sliding_window", False) and sliding:
        return [f"sliding-window attention in layers {sliding} (use_sliding_window); only "
                "full-attention Qwen3 models export"]
    return []


def build(cfg, opts, dtype):
    return llama.build(cfg, opts, dtype, qk_norm=True)
