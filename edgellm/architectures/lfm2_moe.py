"""LFM2-MoE (transformers `model_type: lfm2_moe`, LFM2-8B-A1B): LFM2's conv and attention blocks
(lfm2.py) whose feed-forwards are sparse after the first `num_dense_layers` (moe.py): 32 experts
of `moe_intermediate_size`, 4 chosen per token by sigmoid scores shifted by a per-expert bias
(the bias picks, the unshifted scores weigh), normalised (+1e-6) and scaled by
`routed_scaling_factor`. The dense layers' feed-forward is LFM2's at `intermediate_size`.

Same math and parameter names as transformers' Lfm2MoeForCausalLM; the checkpoint's one tensor
per expert (`feed_forward.experts.N.w1`, w3, w2) is stacked when the folder is read (`merge`).
"""

from __future__ import annotations

import torch

from . import lfm2
from .layers import ModelOptions
from .moe import Routing, SparseMoE, stack_experts
from .registry import Architecture


def routing(cfg) -> Routing:
    return Routing("sigmoid", cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                   cfg.routed_scaling_factor, eps=1e-6, bias=cfg.use_expert_bias)


def check(cfg) -> list[str]:
    out = lfm2.check(cfg)
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        out.append(f"num_experts_per_tok {cfg.num_experts_per_tok} must be in 1.."
                   f"{cfg.num_experts} (num_experts)")
    if not 0 <= cfg.num_dense_layers <= cfg.num_hidden_layers:
        out.append(f"num_dense_layers {cfg.num_dense_layers} exceeds num_hidden_layers "
                   f"{cfg.num_hidden_layers}")
    return out


class Lfm2MoeForCausalLM(lfm2.Lfm2ForCausalLM):
    family = "LFM2-MoE"

    def __init__(self, cfg, opts: ModelOptions, dtype):
        route = routing(cfg)

        def layer(i, kind):
            sparse = (SparseMoE(route, cfg.hidden_size, cfg.moe_intermediate_size)
                      if i >= cfg.num_dense_layers else None)
            return lfm2.DecoderLayer(cfg, kind, opts, dtype, feed_forward=sparse)

        super().__init__(cfg, opts, dtype, layer)


def merge(cfg, state: dict) -> dict:
    """The checkpoint's one tensor per expert stacked, as transformers' loader stacks them."""
    for i in range(cfg.num_dense_layers, cfg.num_hidden_layers):
        stack_experts(state, f"model.layers.{i}.feed_forward", cfg.num_experts, ("w1", "w3", "w2"))
    return state


def build(cfg, opts: ModelOptions, dtype) -> Lfm2MoeForCausalLM:
    with torch.device("meta"):
        return Lfm2MoeForCausalLM(cfg, opts, dtype)


ARCHITECTURE = Architecture(
    model_type="lfm2_moe", summary="LFM2-MoE (LFM2's hybrid with mixture-of-experts "
    "feed-forwards: LFM2-8B-A1B)", build=build, check=check, merge=merge)
