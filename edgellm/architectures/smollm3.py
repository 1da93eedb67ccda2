"""SmolLM3 (transformers `model_type: smollm3`): Llama's layout (llama.py) where every
`no_rope_layer_interval`-th layer has no RoPE (`no_rope_layers[i] == 0`, NoPE).
"""

from __future__ import annotations

from . import llama

ARCHITECTURE = llama.relative(
    "smollm3", "SmolLM3 (Llama layout with NoPE layers)",
    llama.Variant(rotary="smollm3.modeling_smollm3:SmolLM3RotaryEmbedding"), "SmolLM3")
