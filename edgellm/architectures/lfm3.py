"""LFM3 (transformers `model_type: lfm3`): LFM2's short-conv blocks (lfm2.py, kernel 7) with two
kinds of attention block, sliding-window and full, each with its own RoPE (the sliding layers'
theta 10k over the whole head, the full layers' proportional RoPE over half of it).

Same math and parameter names as transformers' Lfm3ForCausalLM. An attention block is Qwen3's
(llama.Attention: per-head q and k norms before RoPE, names q_proj ... o_proj, q_norm, k_norm)
with a sigmoid gate per head on its output (`g_proj`); every block has sandwich norms (after
each branch, `post_operator_norm` and `post_ffn_norm`), and the feed-forward is LFM2's w1/w2/w3
at intermediate_size. A sliding-window layer keeps a ring buffer of its window (cache.KVCache).
"""

from __future__ import annotations

import torch
from torch import nn

from . import lfm2, llama
from .layers import ModelOptions
from .registry import Architecture

KINDS = ("conv", "sliding_attention", "full_attention")
VARIANT = llama.Variant(qk_norm="head", gate="head", rotary="lfm3.modeling_lfm3:Lfm3RotaryEmbedding")


def check(cfg) -> list[str]:
    out = lfm2.kind_problems(cfg, KINDS)
    if "sliding_attention" in (cfg.layer_types or []) and not cfg.sliding_window:
        out.append("layer_types has sliding_attention layers but sliding_window is not set")
    return out


def unsupported(cfg) -> list[str]:
    return ([] if cfg.use_attention_gate else ["use_attention_gate false (every LFM3 "
                                               "checkpoint gates its attention)"]) + (
        [] if cfg.use_sandwich_norm else ["use_sandwich_norm false"]) + (
        ["attention_bias"] if cfg.attention_bias else [])


class Lfm3ForCausalLM(lfm2.Lfm2ForCausalLM):
    family = "LFM3"
    qk_norms = ("q_norm", "k_norm")

    def __init__(self, cfg, opts: ModelOptions, dtype):
        windows = llama.layer_windows(cfg)

        def layer(i, kind):
            attention = (lambda: llama.Attention(cfg, opts, dtype, VARIANT, windows[i], kind))
            return lfm2.DecoderLayer(cfg, kind, opts, dtype, attention, sandwich=True)

        super().__init__(cfg, opts, dtype, layer, llama.hf_ropes(cfg, VARIANT.rotary, opts))
        self.tied = bool(cfg.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _drop_tied_head(self, sd: dict) -> None:
        if self.tied:
            super()._drop_tied_head(sd)


def build(cfg, opts: ModelOptions, dtype) -> Lfm3ForCausalLM:
    with torch.device("meta"):
        return Lfm3ForCausalLM(cfg, opts, dtype)


ARCHITECTURE = Architecture(
    model_type="lfm3", summary="LFM3 (short conv + sliding-window and full attention, gated)",
    build=build, check=check, unsupported=lambda cfg: unsupported(cfg) + llama.unsupported(cfg))
