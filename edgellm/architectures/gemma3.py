"""Gemma 3 (transformers `model_type: gemma3_text`, and the text tower of a `gemma3` folder):
Llama's layout (llama.py) with sandwich norms (before and after each branch), Gemma's norm
weights stored as w - 1, per-head q and k norms, embeddings scaled by sqrt(hidden), GeGLU
(gelu_pytorch_tanh), attention scaled by query_pre_attn_scalar, and two kinds of layer: sliding
window (a ring buffer of the window, its own RoPE theta) and full attention, 5 : 1.
"""

from __future__ import annotations

import dataclasses

from . import llama

ARCHITECTURE = llama.relative(
    "gemma3_text", "Gemma 3 text decoders (sliding-window and global layers, GeGLU)",
    llama.Variant(qk_norm="head", norms="sandwich", norm_offset=True, embed_sqrt=True,
                  rotary="gemma3.modeling_gemma3:Gemma3RotaryEmbedding"), "Gemma 3")

# a gemma3 folder's text decoder, under the names transformers 5 saves (model.language_model.)
# and those of the checkpoints saved before it (language_model.model., language_model.lm_head.)
_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _text_tower(cfg, state_dict: dict):
    """(Gemma3Config, its state dict) -> the text decoder's; the vision tower and projector are
    left out."""
    text = {}
    for key, value in state_dict.items():
        for old, new in _TEXT:
            if key.startswith(old):
                text[new + key[len(old):]] = value
                break
    return cfg.text_config, text


TOWER = dataclasses.replace(
    ARCHITECTURE, model_type="gemma3", tower=_text_tower,
    summary="Gemma 3 multimodal folders: their text decoder (the vision tower is left out)")
ARCHITECTURES = (ARCHITECTURE, TOWER)
