"""Qwen3-MoE (transformers `model_type: qwen3_moe`, Qwen3-30B-A3B): Qwen3's layout (qwen3.py:
Llama's with per-head q and k norms) whose feed-forwards are sparse (moe.py) except in
`mlp_only_layers` and off the `decoder_sparse_step`: `num_experts` experts of
`moe_intermediate_size`, `num_experts_per_tok` chosen per token by a softmax over every expert,
their weights renormalised to sum 1 where `norm_topk_prob` says so.

Same math and parameter names as transformers' Qwen3MoeForCausalLM; the checkpoint's one tensor
per expert (`mlp.experts.N.gate_proj`, up_proj, down_proj) is stacked when the folder is read
(`merge`).
"""

from __future__ import annotations

import dataclasses

from . import llama
from .registry import GgufLayout
from .moe import Routing, SparseMoE, stack_experts


def sparse(cfg, i: int) -> SparseMoE | None:
    """Layer i's sparse block, or None where transformers gives it the dense MLP."""
    if i in (cfg.mlp_only_layers or []) or not cfg.num_experts or (i + 1) % cfg.decoder_sparse_step:
        return None
    route = Routing("softmax", cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return SparseMoE(route, cfg.hidden_size, cfg.moe_intermediate_size)


def merge(cfg, state: dict) -> dict:
    """The checkpoint's one tensor per expert stacked, as transformers' loader stacks them."""
    for i in range(cfg.num_hidden_layers):
        if sparse(cfg, i) is not None:
            stack_experts(state, f"model.layers.{i}.mlp", cfg.num_experts,
                          ("gate_proj", "up_proj", "down_proj"))
    return state


def unsupported(cfg) -> list[str]:
    out = llama.unsupported(cfg)
    if cfg.num_experts and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        out.append(f"num_experts_per_tok {cfg.num_experts_per_tok} outside 1..{cfg.num_experts}")
    return out


def _gguf_fix(raw: dict, key, names: tuple, values) -> None:
    """Qwen3-MoE as llama.cpp writes it (conversion/qwen.py, Qwen2MoeModel's tensors): every
    layer sparse, the experts' width under `expert_feed_forward_length` (transformers' GGUF table
    leaves it out), the chosen weights normalised unless `expert_weights_norm` says otherwise."""
    raw["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    raw["mlp_only_layers"], raw["decoder_sparse_step"] = [], 1


ARCHITECTURE = dataclasses.replace(llama.relative(
    "qwen3_moe", "Qwen3-MoE (Qwen3 with mixture-of-experts feed-forwards: Qwen3-30B-A3B)",
    llama.Variant(qk_norm="head", ffn=sparse), "Qwen3-MoE", unsupported=unsupported,
    gguf=GgufLayout("qwen3moe", keys={
        "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size", "attention.key_length": "head_dim"},
        fix=_gguf_fix)), merge=merge)
