"""SmolLM3 (transformers `model_type: smollm3`): Llama's layout (llama.py) where every
`no_rope_layer_interval`-th layer has no RoPE (`no_rope_layers[i] == 0`, NoPE).
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout


def _gguf_fix(raw: dict, key, names: tuple, values) -> None:
    """llama.cpp leaves RoPE out of every fourth layer, in code: the file says nothing."""
    raw["no_rope_layer_interval"] = 4


ARCHITECTURE = llama.relative(
    "smollm3", "SmolLM3 (Llama layout with NoPE layers)",
    llama.Variant(rotary="smollm3.modeling_smollm3:SmolLM3RotaryEmbedding"), "SmolLM3",
    gguf=GgufLayout("smollm3", permuted=True, fix=_gguf_fix))
