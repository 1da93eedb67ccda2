"""Phi-3 and Phi-4-mini (transformers `model_type: phi3`): Llama's layout (llama.py) with q, k and v
fused in `qkv_proj` and gate and up in `gate_up_proj` (split by rows at load time), partial
rotary (Phi-4-mini rotates 0.75 of each head; the rest passes) and LongRoPE (short factors within
the original context, long ones past it).
"""

from __future__ import annotations

from . import llama

ARCHITECTURE = llama.relative(
    "phi3", "Phi-3 and Phi-4-mini (fused projections, partial rotary, LongRoPE)",
    llama.Variant(fused=True, rotary="phi3.modeling_phi3:Phi3RotaryEmbedding"), "Phi-3")
