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
from .registry import Architecture, GgufLayout


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


def _gguf_fix(raw: dict, key, names: tuple, values) -> None:
    """LFM2-MoE as llama.cpp writes it (conversion/lfm2.py, LFM2MoeModel): attention layers are
    those with key-value heads; experts, their width and the dense leading layers under the
    expert keys; sigmoid gating with a bias (`exp_probs_b`) where the file has one; the chosen
    weights normalised and scaled as `expert_weights_norm` / `_scale` say (llama.cpp's defaults:
    normalised, unscaled)."""
    heads = raw.pop("num_key_value_heads")
    heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * raw["num_hidden_layers"]
    raw["layer_types"] = ["full_attention" if h else "conv" for h in heads]
    raw["num_key_value_heads"] = max(heads)
    raw["norm_eps"] = raw.pop("rms_norm_eps", 1e-5)
    raw["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    raw["routed_scaling_factor"] = float(key("expert_weights_scale", 1.0))
    dense = int(raw.get("num_dense_layers", 0))
    raw["use_expert_bias"] = f"blk.{dense}.exp_probs_b.bias" in names


ARCHITECTURE = Architecture(
    model_type="lfm2_moe", summary="LFM2-MoE (LFM2's hybrid with mixture-of-experts "
    "feed-forwards: LFM2-8B-A1B)", build=build, check=check, merge=merge,
    gguf=GgufLayout("lfm2moe", keys={
        "shortconv.l_cache": "conv_L_cache", "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
        "leading_dense_block_count": "num_dense_layers"}, fix=_gguf_fix, processor="lfm2"))
