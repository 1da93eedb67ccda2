"""Phi-3 and Phi-4-mini (transformers `model_type: phi3`): Llama's layout (llama.py) with q, k and v
fused in `qkv_proj` and gate and up in `gate_up_proj` (split by rows at load time), partial
rotary (Phi-4-mini rotates 0.75 of each head; the rest passes) and LongRoPE (short factors within
the original context, long ones past it).

ExecuTorch's export_llm holds Phi-4-mini as model_class phi_4_mini: Meta's Llama names with q, k,
v and gate, up already split (its convert_weights), params with partial_rotary_factor and the
LongRoPE factors (rope_scaling_short_factor, rope_scaling_long_factor,
original_max_position_embeddings), use_hf_rope.
"""

from __future__ import annotations

from . import llama
from .registry import GgufLayout

_LONG = ("rope_scaling_short_factor", "rope_scaling_long_factor",
         "original_max_position_embeddings")


def _params_problems(p: dict, model_class: str) -> list[str]:
    out = llama.attention_only(p)
    if not p["use_hf_rope"] or p["use_qk_norm"] or p["attention_qkv_bias"]:
        out.append("use_hf_rope must be true and use_qk_norm and attention_qkv_bias false, as in "
                   "ExecuTorch's phi_4_mini config")
    if p["use_scaled_rope"]:
        out.append(llama.UNSCALED_ROPE)
    if p["head_dim"] * p["n_heads"] != p["dim"]:
        out.append(f"head_dim {p['head_dim']} must be dim / n_heads = {p['dim'] / p['n_heads']}")
    given = [k for k in _LONG if p[k] is not None]
    if given and len(given) < len(_LONG):
        out.append(f"LongRoPE needs all of {', '.join(_LONG)}; given only {', '.join(given)}")
    elif given:
        half = int(p["head_dim"] * p["partial_rotary_factor"]) // 2
        out += [f"{k} has {len(p[k])} factors; {half} are needed (head_dim x "
                "partial_rotary_factor / 2)" for k in _LONG[:2] if len(p[k]) != half]
    return out


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import Phi3Config

    rope = {**llama.default_rope(p), "partial_rotary_factor": p["partial_rotary_factor"]}
    if p["rope_scaling_short_factor"] is not None:
        rope.update(rope_type="longrope", short_factor=p["rope_scaling_short_factor"],
                    long_factor=p["rope_scaling_long_factor"],
                    original_max_position_embeddings=p["original_max_position_embeddings"])
    return Phi3Config(**common, rms_norm_eps=p["norm_eps"], rope_parameters=rope,
                      original_max_position_embeddings=p["original_max_position_embeddings"],
                      tie_word_embeddings=tied)


def _gguf_fix(raw: dict, key, names: tuple, values) -> None:
    """Phi-3 and Phi-4-mini as llama.cpp writes them: the rotated share of each head
    (`rope.dimension_count`, 0.75 of it on Phi-4-mini) and LongRoPE's per-frequency factors,
    stored as the tensors `rope_factors_short` / `rope_factors_long` beside
    `rope.scaling.original_context_length`. `attention.sliding_window` is not read: llama.cpp
    runs Phi-3 with full attention."""
    head = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotated = key("rope.dimension_count")
    rope = {"rope_type": "default", "rope_theta": raw.pop("rope_theta", 10000.0)}
    if rotated is not None and int(rotated) != head:
        rope["partial_rotary_factor"] = int(rotated) / head
    original = key("rope.scaling.original_context_length")
    if original is not None and "rope_factors_long.weight" in names:
        rope |= {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                 "short_factor": values("rope_factors_short.weight").tolist(),
                 "long_factor": values("rope_factors_long.weight").tolist()}
        raw["original_max_position_embeddings"] = int(original)
    raw["sliding_window"] = None
    raw["rope_parameters"] = rope


ARCHITECTURE = llama.relative(
    "phi3", "Phi-3 and Phi-4-mini (fused projections, partial rotary, LongRoPE)",
    llama.Variant(fused=True, rotary="phi3.modeling_phi3:Phi3RotaryEmbedding"), "Phi-3",
    executorch=llama.meta_layout(("phi_4_mini",), {}, _params_problems, _config,
                                 reads=("partial_rotary_factor", *_LONG)),
    gguf=GgufLayout("phi3", fix=_gguf_fix))
