"""Qwen2 and Qwen2.5 (transformers `model_type: qwen2`): Llama's layout (llama.py) with biases on
the q, k and v projections (o has none). Sliding-window layers are refused, as for Qwen3.
"""

from __future__ import annotations

from . import llama

check = llama.check


def unsupported(cfg) -> list[str]:
    return llama.sliding_layers(cfg, "Qwen2")


def build(cfg, opts, dtype):
    return llama.build(cfg, opts, dtype, llama.Variant(qkv_bias=True))
