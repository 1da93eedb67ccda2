"""Granite 3.x (transformers `model_type: granite`): Llama's layout (llama.py) with four
multipliers from the config: embedding_multiplier on the embeddings, residual_multiplier on each
branch, attention_multiplier as the attention scale, and logits divided by logits_scaling.
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout

ARCHITECTURE = llama.relative(
    "granite", "Granite 3.x (Llama layout with embedding, residual, attention and logit "
    "multipliers)", llama.Variant(rotary="granite.modeling_granite:GraniteRotaryEmbedding"),
    "Granite", gguf=GgufLayout("granite", permuted=True, keys={
        "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}))
