"""Gemma 3 (transformers `model_type: gemma3_text`, and the text tower of a `gemma3` folder):
Llama's layout (llama.py) with sandwich norms (before and after each branch), Gemma's norm
weights stored as w - 1, per-head q and k norms, embeddings scaled by sqrt(hidden), GeGLU
(gelu_pytorch_tanh), attention scaled by query_pre_attn_scalar, and two kinds of layer: sliding
window (a ring buffer of the window, its own RoPE theta) and full attention, 5 : 1.
"""

from __future__ import annotations

import dataclasses

from . import llama
from .registry import GgufLayout, text_tensors


def _gguf_fix(raw: dict, key, names: tuple, values) -> None:
    """llama.cpp's Gemma 3: the local RoPE base in `rope.freq_base_swa` (10 000 when absent),
    five local layers to a global one unless `attention.sliding_window_pattern` says otherwise,
    linear RoPE scaling of the global layers (4B and up) in `rope.scaling.*`, the logit soft cap
    when the model has one, and q scaled by 1/sqrt(head_dim) except on the 62-layer 27B
    (1/sqrt(hidden / heads)): none of these are in transformers' key table."""
    full = {"rope_type": "default", "rope_theta": raw.pop("rope_theta", 1e6)}
    if key("rope.scaling.type") == "linear":
        full |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    raw["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}}
    pattern = key("attention.sliding_window_pattern", 6)  # or a flag per layer
    sliding = pattern if isinstance(pattern, list) else [
        i % pattern < pattern - 1 for i in range(raw["num_hidden_layers"])]
    raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    cap = key("final_logit_softcapping")
    raw["final_logit_softcapping"] = float(cap) if cap else None
    heads, width = raw["num_attention_heads"], raw["hidden_size"]
    raw["query_pre_attn_scalar"] = (width // heads if raw["num_hidden_layers"] == 62
                                    else raw.get("head_dim", 256))


ARCHITECTURE = llama.relative(
    "gemma3_text", "Gemma 3 text decoders (sliding-window and global layers, GeGLU)",
    llama.Variant(qk_norm="head", norms="sandwich", norm_offset=True, embed_sqrt=True,
                  rotary="gemma3.modeling_gemma3:Gemma3RotaryEmbedding"), "Gemma 3",
    gguf=GgufLayout("gemma3", fix=_gguf_fix))

# a gemma3 folder's text decoder, under the names transformers 5 saves (model.language_model.)
# and those of the checkpoints saved before it (language_model.model., language_model.lm_head.)
_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _text_tower(cfg, state_dict: dict):
    """(Gemma3Config, its state dict) -> the text decoder's; the vision tower and projector are
    left out."""
    return cfg.text_config, text_tensors(state_dict, _TEXT)


TOWER = dataclasses.replace(
    ARCHITECTURE, model_type="gemma3", tower=_text_tower, gguf=None,
    summary="Gemma 3 multimodal folders: their text decoder (the vision tower is left out)")
ARCHITECTURES = (ARCHITECTURE, TOWER)
