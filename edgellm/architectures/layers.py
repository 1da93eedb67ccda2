"""Layers shared by the architectures: RMSNorm, rotary embedding, and attention over a static cache.

These follow transformers' math exactly; what differs is how they are written, because the way a
model is written decides what a backend receives (see ../shared/reference/lowering-findings.md):
- RMSNorm has three spellings of the same formula, chosen by the backend (`norm`).
- RoPE gathers precomputed cos/sin rows at the step's positions and rotates half the head with a
  signed permutation matrix (one linear) instead of slices and a cat.
- Attention keeps a static KV cache per layer as mutable buffers, written either with ExecuTorch's
  `llama::update_cache` / `llama::custom_sdpa` ops or with `index_put_` and ATen SDPA, where the
  query heads are grouped against the unexpanded cache instead of repeating K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("mean", "rms_norm", "linear_mean")
ATTENTIONS = ("custom_ops", "sdpa")


@dataclass(frozen=True)
class ModelOptions:
    """How to write the model for a backend, and the sizes of its state."""

    max_context_len: int = 128
    attention: str = "sdpa"
    norm: str = "mean"
    state_write: str = "copy"  # how recurrent state is written back: "copy" or "index_put"


@dataclass
class Step:
    """Per-call values computed once at the top of the model and shared by every layer."""

    positions: torch.Tensor  # (T,) absolute positions of this call's tokens
    start: torch.Tensor  # (1,) input_pos
    start_int: object  # input_pos as an int (SymInt under export) for the custom ops, else None
    fresh: torch.Tensor  # () 1.0 when this call starts a sequence (input_pos == 0), else 0.0


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like transformers.

    mode "mean": x * rsqrt(mean(x*x)) - a few ops everywhere, no overflow guard in fp16.
    mode "rms_norm": F.rms_norm - one ATen node.
    mode "linear_mean": the mean as a linear with a constant 1/D row, which XNNPACK keeps whole.
    """

    def __init__(self, dim: int, eps: float, mode: str = "mean"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.mode = eps, mode
        if mode == "linear_mean":
            self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim, device="cpu"),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if self.mode == "rms_norm":
            y = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        elif self.mode == "linear_mean":
            y = x * torch.rsqrt(F.linear(x * x, self.mean_row.float()) + self.eps)
        else:
            y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dtype)


class Rope(nn.Module):
    """Rotary tables for every position up to max_context_len, gathered per call."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_context_len: int):
        super().__init__()
        pos = torch.arange(max_context_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)  # (ctx, head_dim)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        d = emb.shape[-1]
        half = d // 2
        rot = torch.zeros(d, d)  # rotate_half(x) == x @ rot.T: [-x2, x1]
        rot[torch.arange(half), torch.arange(half) + half] = -1.0
        rot[torch.arange(half) + half, torch.arange(half)] = 1.0
        self.register_buffer("rot", rot, persistent=False)

    def tables(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (T, head_dim) each, broadcast over heads by the caller
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + F.linear(x, self.rot.to(x.dtype)) * sin


class KVCache(nn.Module):
    """A static cache for one attention layer, attention included, batch 1.

    "custom_ops": caches (1, ctx, n_kv, D), written by llama::update_cache at input_pos and read by
    llama::custom_sdpa, which handles grouped heads and the causal mask itself.
    "sdpa": caches (1, n_kv, ctx, D), written by index_put_; queries are grouped per KV head as
    (1, n_kv, n_rep*T, D) so SDPA sees equal head counts without repeating K and V.
    """

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, opts: ModelOptions, dtype):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.mode, self.ctx = opts.attention, opts.max_context_len
        if self.mode == "custom_ops":
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama::
        shape = ((1, self.ctx, n_kv, head_dim) if self.mode == "custom_ops"
                 else (1, n_kv, self.ctx, head_dim))
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, q, k, v, step: Step) -> torch.Tensor:
        """q (1, T, H, D), k and v (1, T, n_kv, D) -> attention output (1, T, H*D)."""
        T = q.shape[1]
        if self.mode == "custom_ops":
            torch.ops.llama.update_cache(k, self.k_cache, step.start_int)
            torch.ops.llama.update_cache(v, self.v_cache, step.start_int)
            out = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, step.start_int,
                                              None, 0.0, True, None)
            return out.reshape(1, T, -1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (1, n_kv, T, D)
        self.k_cache[:, :, step.positions] = k  # index_put_: one MIL slice_update on Core ML
        self.v_cache[:, :, step.positions] = v
        n_rep = self.n_heads // self.n_kv
        q = q.transpose(1, 2).reshape(1, self.n_kv, n_rep * T, self.head_dim)
        visible = torch.arange(self.ctx, device=q.device)[None, :] <= step.positions[:, None]
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache,
                                             attn_mask=mask.repeat(n_rep, 1))
        # (1, n_kv, n_rep*T, D) -> (1, n_kv, n_rep, T, D) -> (1, T, H*D). Where SDPA gets
        # decomposed (portable, Vulkan) its output has permuted strides, and merging the head dims
        # with a view fails at lowering; the explicit copy makes the merge stride-independent.
        out = out.view(1, self.n_kv, n_rep, T, self.head_dim).permute(0, 3, 1, 2, 4)
        if n_rep > 1:
            out = out.clone(memory_format=torch.contiguous_format)
        return out.reshape(1, T, -1)


def make_step(input_pos: torch.Tensor, T: int, opts: ModelOptions) -> Step:
    start_int = None
    if opts.attention == "custom_ops":
        start_int = input_pos[0].item()
        torch._check(start_int >= 0)
        torch._check(start_int + T <= opts.max_context_len)
    positions = input_pos + torch.arange(T, device=input_pos.device)
    fresh = (input_pos[0] == 0).float()
    return Step(positions=positions, start=input_pos, start_int=start_int, fresh=fresh)


def run_decoder(lm: nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor, final_norm: nn.Module,
                head: torch.Tensor) -> torch.Tensor:
    """The top of every architecture: embed, every layer, final norm and head on the last token.
    `lm` has `.opts`, `.rope` and `.model` with `embed_tokens` and `layers`."""
    step = make_step(input_pos, tokens.shape[1], lm.opts)
    x = lm.model.embed_tokens(tokens)  # (1, T, hidden)
    cos, sin = lm.rope.tables(step.positions, x.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, head_dim)
    for layer in lm.model.layers:
        x = layer(x, lm.rope, cos, sin, step)
    return F.linear(final_norm(x[:, -1, :]), head)  # (1, vocab)
