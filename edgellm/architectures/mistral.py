"""Mistral and Ministral (transformers `model_type: mistral`, `ministral`): Llama's layout
(llama.py) with a sliding window, in every layer (Mistral, when `sliding_window` is set) or in
the layers `layer_types` names (Ministral). A sliding-window layer keeps a ring buffer of its
window (cache.KVCache).
"""

from __future__ import annotations

from . import llama

ARCHITECTURES = (
    llama.relative("mistral", "Mistral (Llama layout, sliding window in every layer)",
                   llama.Variant(rotary="mistral.modeling_mistral:MistralRotaryEmbedding"),
                   "Mistral"),
    llama.relative("ministral", "Ministral (Llama layout, sliding and full layers)",
                   llama.Variant(rotary="ministral.modeling_ministral:MinistralRotaryEmbedding"),
                   "Ministral"))
ARCHITECTURE = ARCHITECTURES[0]
