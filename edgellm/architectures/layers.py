"""Layers shared by the architectures: RMSNorm, rotary embedding, and attention over a static cache.

These follow transformers' math exactly; what differs is how they are written, because the way a
model is written decides what a backend receives (see ../shared/reference/lowering-findings.md):
- RMSNorm has three spellings of the same formula, chosen by the backend (`norm`).
- RoPE gathers precomputed cos/sin rows at the step's positions and rotates half the head with a
  signed permutation matrix (one linear) instead of slices and a cat.
- Attention keeps a static KV cache per layer as mutable buffers, written either with ExecuTorch's
  `llama::update_cache` / `llama::custom_sdpa` ops or with `index_put_` and ATen SDPA, where the
  query heads are grouped against the unexpanded cache instead of repeating K and V.
- A sliding-window layer keeps a ring buffer of its window instead (`KVCache` with a window):
  position p lives in slot p mod R, written in place, and the mask says which slots are in reach.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError


@dataclass(frozen=True)
class ModelOptions:
    """How to write the model for a backend, and the sizes of its state."""

    max_context_len: int = 128
    max_call_len: int = 128  # the most tokens one call takes (ring buffers hold window + this - 1)
    attention: str = "sdpa"
    norm: str = "mean"
    state_write: str = "copy"  # how recurrent state is written back: "copy" or "index_put"
    rope: str = "rotate"  # "rotate": x*cos + rot(x)*sin; "matrix": one matmul per q and k
    conv: str = "conv1d"  # LFM2 short conv: "conv1d" (channels-first) or "window" (time-major)
    fold_norms: bool = False  # fold RMSNorm weights into the linears that follow them
    fuse_qk: bool = False  # LFM2, Qwen3: q and k projections, norms and RoPE as one (fused_qk)
    separate_head: bool = False  # a tied head as its own parameter over the embedding's storage
    # gated DeltaNet's recurrence over a call's tokens (Qwen3.5): "op", ExecuTorch's
    # llama::gated_delta_rule (any T); "loop", token by token in plain ops (T fixed)
    delta_rule: str = "loop"
    kv_cache: str | None = None  # None: caches in the model's dtype; "int8": quantized (KVCache)
    # (sink, window): full-attention caches keep the first `sink` positions and a ring of the
    # last `window`, and the program takes positions past max_context_len (KVCache, Rope)
    attention_sink: tuple[int, int] | None = None


@dataclass
class Step:
    """Per-call values computed once at the top of the model and shared by every layer."""

    positions: torch.Tensor  # (T,) absolute positions of this call's tokens
    start_int: object  # input_pos as an int (SymInt under export) for the custom ops, else None
    keep: torch.Tensor  # () 0 when this call starts a sequence (input_pos == 0), else 1
    mask: torch.Tensor | None  # (T, ctx) additive attention mask ("sdpa" attention)
    ropes: dict  # rotation kind (FULL, or a layer type with its own RoPE) -> x (1, T, heads, D)
    #              -> x rotated for these positions
    single: bool  # T is fixed at 1 in this program (a static decode step)
    dtype: torch.dtype = torch.float32
    ring_masks: dict = field(default_factory=dict)  # (ring, window, sink) -> ring_mask, made once
    tables: dict = field(default_factory=dict)  # rotation kind -> Rope, for sink_rotation
    sink_rotations: dict = field(default_factory=dict)  # (kind, sink, window) -> rotation

    @property
    def rope(self) -> Callable:
        return self.ropes[FULL]

    def ring_mask(self, ring: int, window: int, sink: int = 0) -> torch.Tensor:
        """(T, sink + ring) additive mask of a ring buffer of `ring` slots after this call's
        write, behind `sink` slots holding positions 0..sink-1: ring slot s holds the latest
        position p >= sink, p <= the call's last, with p - sink = s (mod ring); query i sees it
        when it is written, not in its future, and within `window` positions back; it sees a sink
        slot once written, however far back. Made once per call for every layer with the same
        ring, window and sink."""
        if (ring, window, sink) not in self.ring_masks:
            last = self.positions[-1:]
            after = last - sink if sink else last  # (no op in the graph of a plain ring)
            held = last - (after - torch.arange(ring)) % ring  # (ring,)
            back = self.positions[:, None] - held[None, :]  # (T, ring)
            reach = (held >= sink) & (back >= 0) & (back < window)
            if sink:
                written = torch.arange(sink)[None, :] <= self.positions[:, None]  # (T, sink)
                reach = torch.cat([written, reach], dim=1)
            self.ring_masks[ring, window, sink] = torch.zeros(
                reach.shape, dtype=self.dtype).masked_fill(~reach, float("-inf"))
        return self.ring_masks[ring, window, sink]

    def ring_slots(self, ring: int, sink: int = 0) -> torch.Tensor:
        """(T,) the slot each of this call's positions is written at: position p mod ring, or
        behind `sink` slots, p itself below sink and sink + (p - sink) mod ring from there."""
        if not sink:
            return self.positions % ring
        return torch.where(self.positions < sink, self.positions,
                           sink + (self.positions - sink) % ring)

    def sink_rotation(self, kind: str, sink: int, window: int) -> Callable:
        """The rotation that moves sink keys (rotated at positions 0..sink-1 when written) to sit
        just before the window of this call's first query, as StreamingLLM positions them within
        the cache: by max(0, first - window + 1 - sink) positions. The window's keys keep their
        true distances, so every key is then where StreamingLLM puts it for a one-token call."""
        if (kind, sink, window) not in self.sink_rotations:
            shift = (self.positions[:1] - window + 1 - sink).clamp(min=0)
            self.sink_rotations[kind, sink, window] = self.tables[kind].prepare(
                shift.expand(sink), self.dtype, unbounded=True)
        return self.sink_rotations[kind, sink, window]


FULL = "full_attention"  # the rotation of a model with one RoPE, and of its full-attention layers


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like transformers.

    mode "mean": x * rsqrt(mean(x*x)) - a few ops everywhere, no overflow guard in fp16.
    mode "rms_norm": F.rms_norm - one ATen node; Core ML expands it with an fp16 overflow guard.
    mode "linear_mean": the mean as a linear with a constant 1/D row, which XNNPACK keeps whole.
    Without `affine` the weight has been folded into the linears that read the output.
    """

    def __init__(self, dim: int, eps: float, mode: str = "mean", affine: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.eps, self.mode = eps, mode
        if mode == "linear_mean":
            self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim, device="cpu"),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, w = x.dtype, self.weight
        if self.mode == "rms_norm" and dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps=self.eps)  # weight inside: one node
        x = x.float()
        if self.mode == "rms_norm":
            y = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        elif self.mode == "linear_mean":
            y = x * torch.rsqrt(F.linear(x * x, self.mean_row.float()) + self.eps)
        else:
            y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)
        return y.to(dtype) if w is None else w * y.to(dtype)


def fold_norm(sd: dict, norm: str, linears: list[str]) -> None:
    """W @ (w * y) == (W * w) @ y: move RMSNorm weight `norm` into the input columns of
    `linears` (state-dict keys without `.weight`), leaving the norm without weight."""
    missing = [k for k in [norm, *linears] if f"{k}.weight" not in sd]
    if missing:
        raise InputError(f"Checkpoint lacks {', '.join(f'{k}.weight' for k in missing)}. Check "
                         "that the weights and config.json come from the same model.")
    w = sd.pop(f"{norm}.weight").float()
    for name in linears:
        sd[f"{name}.weight"] = sd[f"{name}.weight"].float() * w


class Rope(nn.Module):
    """Rotary tables for every position up to max_context_len, gathered per call.

    "rotate": x*cos + rotate_half(x)*sin with rotate_half as a signed permutation (one linear).
    "matrix": per position one (D, D) matrix diag(cos) + rot^T diag(sin), built once per call
    and applied to q and k as one matmul each.
    A program with attention sinks takes positions past any table: its rows are computed per
    call from the positions instead (`prepare(..., unbounded=True)`), with the table's formula.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_context_len: int,
                 mode: str = "rotate", head_dim: int | None = None, long: tuple | None = None):
        """`head_dim` beyond 2 * len(inv_freq): partial rotary (Phi-3), the rest of each head passes
        unrotated (cos 1, sin 0). `long`: (inv_freq, first position) of LongRoPE, whose positions
        from the original context on rotate with the long factors."""
        super().__init__()
        self.mode, self.scaling = mode, scaling
        self.long_from = None if long is None else long[1]
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("long_inv_freq", (inv_freq if long is None else long[0]).float(),
                             persistent=False)
        d = head_dim or 2 * inv_freq.shape[0]
        self.pad = d - 2 * inv_freq.shape[0]
        cos, sin = self._rows(torch.arange(max_context_len, dtype=torch.float32))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        half = inv_freq.shape[0]
        rot = torch.zeros(d, d)  # rotate_half(x) == x @ rot.T: [-x2, x1] over the rotated dims
        rot[torch.arange(half), torch.arange(half) + half] = -1.0
        rot[torch.arange(half) + half, torch.arange(half)] = 1.0
        self.register_buffer("rot", rot, persistent=False)
        if mode == "matrix":
            self.register_buffer("eye", torch.eye(d), persistent=False)
            self.register_buffer("rot_t", rot.T.contiguous(), persistent=False)

    def _rows(self, pos: torch.Tensor) -> tuple:
        """cos and sin rows (len(pos), 1, D) at float positions `pos`."""
        freqs = pos[:, None] * self.inv_freq[None, :]
        if self.long_from is not None:
            freqs = torch.where(pos[:, None] >= self.long_from,
                                pos[:, None] * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (n, 1, rotated dims)
        return (F.pad(emb.cos() * self.scaling, (0, self.pad), value=1.0),
                F.pad(emb.sin() * self.scaling, (0, self.pad)))

    def prepare(self, positions: torch.Tensor, dtype, unbounded: bool = False):
        """The rotation for these positions, as a function of x (1, T, heads, D)."""
        if unbounded:
            cos, sin = (t.to(dtype) for t in self._rows(positions.float()))
        else:
            cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # (T, 1, D)
        if self.mode == "matrix":
            rotation = self.eye.to(dtype) * cos + self.rot_t.to(dtype) * sin  # (T, D, D)
            return lambda x: x @ rotation  # batched over T: (heads, D) @ (D, D)
        rot = self.rot.to(dtype)
        return lambda x: x * cos + F.linear(x, rot) * sin


def heads_axis(step: Step) -> int:
    """Where split_heads puts the heads: 1 for sdpa attention with T fixed at 1, else 2."""
    return 1 if step.single and step.mask is not None else 2


def split_heads(x: torch.Tensor, n: int, head_dim: int, step: Step) -> torch.Tensor:
    """(1, T, n*D) -> (1, T, n, D), which norms and RoPE take. For "sdpa" attention with T fixed
    at 1, (1, n, 1, D) instead: norms and RoPE work on it unchanged and it is already the cache
    layout, so no second view reaches the backend."""
    if heads_axis(step) == 1:
        return x.view(1, n, 1, head_dim)
    return x.view(1, -1, n, head_dim)  # -1, not a symbolic T: XNNPACK takes only static views


def fused_qk(attn: nn.Module, x: torch.Tensor, step: Step, rope: Callable) -> tuple:
    """q and k of an attention whose q and k heads are normalized before RoPE (LFM2, Qwen3),
    written as one: `attn.qk_proj` (q_proj and k_proj concatenated at load time), one weightless
    RMSNorm over every head (`attn.qk_layernorm`), one per-head weight multiply (`attn.qk_weight`,
    (H + n_kv, 1, D)) and one RoPE. Core ML then receives one guarded norm per attention layer
    instead of two. `rope` rotates (None: a layer without RoPE). Returns (q, k) as split_heads
    lays them out."""
    n, kv, d = attn.n_heads, attn.n_kv, attn.head_dim
    qk = split_heads(attn.qk_proj(x), n + kv, d, step)
    axis = heads_axis(step)  # (1, H+n_kv, 1, D) or (1, T, H+n_kv, D)
    weight = attn.qk_weight if axis == 1 else attn.qk_weight.squeeze(1)
    qk = attn.qk_layernorm(qk) * weight
    qk = rope(qk) if rope is not None else qk
    return qk.narrow(axis, 0, n), qk.narrow(axis, n, kv)


def fuse_qk_weights(sd: dict, prefix: str, norms: tuple[str, str], n_heads: int,
                    n_kv: int) -> None:
    """The checkpoint side of fused_qk for the attention at `prefix`: q_proj and k_proj -> qk_proj
    (rows q then k); the q and k norm weights (`norms`, module names) -> qk_weight per head. A
    tensor missing leaves the attention as it is, for the loader to name."""
    names = [f"{prefix}.{n}.weight" for n in ("q_proj", "k_proj", *norms)]
    if any(n not in sd for n in names):
        return
    q, k, qn, kn = (sd.pop(n) for n in names)
    sd[f"{prefix}.qk_proj.weight"] = torch.cat([q, k])
    sd[f"{prefix}.qk_weight"] = torch.cat([qn.expand(n_heads, -1),
                                          kn.expand(n_kv, -1)])[:, None, :]


def to_heads(x: torch.Tensor, step: Step) -> torch.Tensor:
    """split_heads' result -> (1, n, T, D) for the cache."""
    return x if step.single else x.transpose(1, 2)


def write_at(buffer: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[..., index, ...] = values along `dim`, as one index_put_ (the `[]=` spelling adds a
    reshape of the values per write)."""
    torch.ops.aten.index_put_(buffer, [None] * dim + [index], values)


class WindowConv(nn.Module):
    """A depthwise conv's parameters in time-major layout: weight (L, channels), bias
    (channels)."""

    def __init__(self, d: int, L: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(L, d))
        self.bias = nn.Parameter(torch.empty(d)) if bias else None


class CausalConv(nn.Module):
    """The state of a depthwise causal conv of kernel L over a call's tokens (LFM2's short conv,
    Qwen3.5's DeltaNet): each call convolves [state, x] without padding and keeps the last L-1
    steps, so prefill and decode are one code path; the state is zeroed when a call starts a
    sequence. "conv1d": state (1, channels, L-1) and F.conv1d channels-first. "window": state
    (1, L-1, channels) and a multiply-and-sum over the time-major window with no transposes
    (Core ML); the weight is then (L, channels) (`WindowConv`, transposed at load time)."""

    def init_state(self, d: int, L: int, opts: ModelOptions, dtype) -> None:
        self.state_write, self.window = opts.state_write, opts.conv == "window"
        shape = (1, L - 1, d) if self.window else (1, d, L - 1)
        self.register_buffer("conv_state", torch.zeros(shape, dtype=dtype, device="cpu"),
                             persistent=False)
        self.register_buffer("state_cols", torch.arange(L - 1, device="cpu"), persistent=False)

    def conv_module(self, d: int, L: int, bias: bool) -> nn.Module:
        return (WindowConv(d, L, bias) if self.window
                else nn.Conv1d(d, d, kernel_size=L, groups=d, bias=bias))

    def causal_conv(self, conv: nn.Module, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x (1, T, channels) through `conv` after the state, which then holds x's last L-1
        steps: (1, T, channels)."""
        T, keep = x.shape[1], self.conv_state.shape[1 if self.window else 2]
        if self.window:
            window = torch.cat([self.conv_state * step.keep, x], dim=1)  # (1, L-1+T, D)
            self._write(window[:, -keep:, :])
            return self._window_conv(conv, window, T)
        window = torch.cat([self.conv_state * step.keep, x.transpose(1, 2)], dim=-1)
        self._write(window[:, :, -keep:])  # (1, D, L-1)
        return F.conv1d(window, conv.weight, conv.bias, groups=window.shape[1]).transpose(1, 2)

    def _write(self, new_state):
        if self.state_write == "index_put":
            write_at(self.conv_state, 1 if self.window else 2, self.state_cols, new_state)
        else:
            self.conv_state.copy_(new_state)

    @staticmethod
    def _window_conv(conv, window, T):
        """y[t] = sum_k w[k] * window[t + k]: (1, L-1+T, D) -> (1, T, D)."""
        w = conv.weight  # (L, D)
        if T == 1:
            y = (window * w).sum(1, keepdim=True)
        else:
            y = sum(window[:, k:k + T, :] * w[k] for k in range(w.shape[0]))
        return y if conv.bias is None else y + conv.bias


def time_major_conv(sd: dict, suffix: str) -> None:
    """Depthwise conv weights (channels, 1, L) under keys ending in `suffix` -> (L, channels),
    for the "window" conv."""
    for key in [k for k in sd if k.endswith(suffix)]:
        w = sd[key]
        sd[key] = w.reshape(w.shape[0], w.shape[-1]).T.contiguous() if w.dim() == 3 else w


def ring_slots(window: int | None, opts: ModelOptions) -> int:
    """Cache length of an attention layer: max_context_len, or for a sliding window shorter than
    that the ring of window + max_call_len - 1 slots. A call's tokens then never overwrite a
    position one of them still sees: query p needs p - window + 1 .. p, and the call's writes
    evict only positions before its first query's window."""
    if window is None or window >= opts.max_context_len:
        return opts.max_context_len
    return min(opts.max_context_len, window + opts.max_call_len - 1)


class KVCache(nn.Module):
    """A static cache for one attention layer, attention included, batch 1.

    "custom_ops": caches (1, ctx, n_kv, D), written by llama::update_cache at input_pos and read by
    llama::custom_sdpa, which handles grouped heads and the causal mask itself.
    "sdpa": caches (1, n_kv, ctx, D), written by index_put_; queries are grouped per KV head as
    (1, n_kv, n_rep*T, D) so SDPA sees equal head counts without repeating K and V.

    With a `window` shorter than the context (a sliding-window layer), ctx is the ring's length
    (ring_slots): a call writes its tokens at slot position mod ring in place (one
    llama::update_cache_with_indices or index_put_ per cache) and attends through
    Step.ring_mask. `scale` replaces SDPA's 1/sqrt(D) (Gemma 3, Granite).

    With attention sinks (opts.attention_sink = (sink, window)) a layer without a shorter window
    of its own keeps `sink` slots for positions 0..sink-1 ahead of such a ring of `window`: it
    takes any position, and its sink keys (kept as written in `sink_k`) are rotated each call to
    sit just before the window (Step.sink_rotation, by the RoPE of `rope_kind`, the Step.ropes
    entry its keys rotate with; None: no RoPE), so a one-token call attends exactly as
    StreamingLLM does.
    """

    def __init__(self, n_heads: int, n_kv: int, head_dim: int, opts: ModelOptions, dtype,
                 window: int | None = None, scale: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.mode, self.ctx, self.scale = opts.attention, ring_slots(window, opts), scale
        self.window = window if window is not None and window < opts.max_context_len else None
        self.sink, self.rope_kind, self.state_write = 0, FULL, opts.state_write
        if opts.attention_sink is not None and (window is None or window >= opts.attention_sink[1]):
            self.sink, self.window = opts.attention_sink
            self.ctx = self.sink + self.window + opts.max_call_len - 1
            self.register_buffer("sink_k", torch.zeros(1, self.sink, n_kv, head_dim, dtype=dtype),
                                 persistent=False)
        self.dtype, self.int8 = dtype, opts.kv_cache == "int8"
        if self.mode == "custom_ops":
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama::
        shape = ((1, self.ctx, n_kv, head_dim) if self.mode == "custom_ops"
                 else (1, n_kv, self.ctx, head_dim))
        store = torch.int8 if self.int8 else dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=store), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=store), persistent=False)
        if self.int8:  # per (token, head) row: a float32 scale and an int8 zero point
            if self.mode != "custom_ops":
                raise ValueError("an int8 KV cache is written with ExecuTorch's custom ops only")
            import executorch.kernels.quantized  # noqa: F401  quantized_decomposed:: out variants
            for name in INT8_CACHE:
                self.register_buffer(name, torch.zeros(
                    (*shape[:3], 1), dtype=torch.float32 if name.endswith("scales") else
                    torch.int8), persistent=False)

    def forward(self, q, k, v, step: Step) -> torch.Tensor:
        """q, k and v from split_heads -> attention output (1, T, H*D)."""
        if self.int8:
            return self._int8(q, k, v, step)
        if self.window is not None:
            return self._windowed(q, k, v, step)
        if self.mode == "custom_ops":  # (1, T, heads, D)
            torch.ops.llama.update_cache(k, self.k_cache, step.start_int)
            torch.ops.llama.update_cache(v, self.v_cache, step.start_int)
            out = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, step.start_int,
                                              None, 0.0, True, self.scale)
            return out.view(1, -1, self.n_heads * self.head_dim)
        k, v = to_heads(k, step), to_heads(v, step)
        if step.start_int is None:  # index_put_: one MIL slice_update on Core ML
            write_at(self.k_cache, 2, step.positions, k)
            write_at(self.v_cache, 2, step.positions, v)
        else:  # several tokens, a fixed number: coremltools' index_put takes one index only
            self.k_cache.narrow(2, step.start_int, k.shape[2]).copy_(k)
            self.v_cache.narrow(2, step.start_int, v.shape[2]).copy_(v)
        return self._grouped_sdpa(q, step, step.mask)

    def _int8(self, q, k, v, step: Step) -> torch.Tensor:
        """ExecuTorch's int8 cache (export_llm's quantize_kv_cache): k and v quantized per (token,
        head) row as they are written (values, scales and zero points: three writes per cache),
        the query quantized the same way, and llama::custom_quantized_sdpa over the int8 cache.
        A ring (sliding window) writes at its slots and attends through the ring mask."""
        mask = index = None
        if self.window is not None:
            slots, mask = self._ring(step)
            index, mask = slots[None, :], mask.float()  # (1, T) distinct slots
        sinks = self._sinks(k, step)
        for x, name, first in ((k, "k", sinks), (v, "v", None)):
            buffers = (f"{name}_cache", f"{name}_cache_scales", f"{name}_cache_zero_points")
            for part, buffer in zip(quantize_rows(x), buffers):
                if index is None:
                    torch.ops.llama.update_cache(part, getattr(self, buffer), step.start_int)
                else:
                    torch.ops.llama.update_cache_with_indices(part, getattr(self, buffer), 0,
                                                              index)
            if first is not None:  # the sink keys, moved to sit before the window
                for part, buffer in zip(quantize_rows(first), buffers):
                    torch.ops.llama.update_cache(part, getattr(self, buffer), 0)
        q8, q_scales, q_zeros = quantize_rows(q)
        out = torch.ops.llama.custom_quantized_sdpa(
            q8, self.k_cache, self.v_cache, 0 if mask is not None else step.start_int, mask, 0.0,
            mask is None, self.scale, q_zeros, q_scales, self.k_cache_zero_points,
            self.k_cache_scales, self.v_cache_zero_points, self.v_cache_scales)
        return out.to(q.dtype).view(1, -1, self.n_heads * self.head_dim)

    def _ring(self, step: Step) -> tuple:
        """(slots (T,), mask (T, ctx)) of a ring, behind its sink slots if it has them. T <=
        max_call_len <= ring, so a call's slots are distinct."""
        ring = self.ctx - self.sink
        return step.ring_slots(ring, self.sink), step.ring_mask(ring, self.window, self.sink)

    def _sinks(self, k, step: Step):
        """With sinks: `sink_k` takes this call's keys at positions below `sink` (as written,
        (1, T, n_kv, D)), and the sink keys come back rotated to sit before the window, (1, sink,
        n_kv, D), for the cache's first slots. None without sinks."""
        if not self.sink:
            return None
        k = k if heads_axis(step) == 2 else k.transpose(1, 2)  # (1, T, n_kv, D)
        rows, first, last = torch.arange(self.sink), step.positions[:1], step.positions[-1:]
        taken = ((rows >= first) & (rows <= last))[None, :, None, None]
        if not step.single:  # the row of this call at each sink slot (any where not taken)
            k = k.index_select(1, torch.minimum((rows - first).clamp(min=0), last - first))
        kept = torch.where(taken, k, self.sink_k)  # (one token: broadcast, no gather)
        if self.state_write == "index_put":
            write_at(self.sink_k, 1, rows, kept)
        else:
            self.sink_k.copy_(kept)
        if self.rope_kind is None:
            return kept
        return step.sink_rotation(self.rope_kind, self.sink, self.window)(kept)

    def _windowed(self, q, k, v, step: Step) -> torch.Tensor:
        slots, mask = self._ring(step)
        sinks = self._sinks(k, step)
        if self.mode == "custom_ops":
            index = slots[None, :]
            if mask.dtype == torch.bfloat16:  # the op's checks take an fp32 or fp16 mask only
                mask = mask.float()
            torch.ops.llama.update_cache_with_indices(k, self.k_cache, 0, index)
            if sinks is not None:
                torch.ops.llama.update_cache(sinks, self.k_cache, 0)
            torch.ops.llama.update_cache_with_indices(v, self.v_cache, 0, index)
            out = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, 0, mask, 0.0, False,
                                              self.scale)
            return out.view(1, -1, self.n_heads * self.head_dim)
        k, v = to_heads(k, step), to_heads(v, step)
        if step.start_int is None:  # index_put_: one MIL slice_update on Core ML
            write_at(self.k_cache, 2, slots, k)
            if sinks is not None:  # the first slots: a slice (Core ML: slice_update)
                self.k_cache.narrow(2, 0, self.sink).copy_(sinks.transpose(1, 2))
            write_at(self.v_cache, 2, slots, v)
        else:  # a fixed number of tokens > 1: coremltools' index_put takes one index only
            self._rewrite(self.k_cache, k, step)
            self._rewrite(self.v_cache, v, step)
        return self._grouped_sdpa(q, step, mask)

    def _rewrite(self, cache, new, step: Step) -> None:
        """The ring after a call of T > 1 tokens, written whole: slot s takes token
        (s - start) mod ring of this call where that is < T, else keeps what it held."""
        T = new.shape[2]
        source = (torch.arange(self.ctx) - step.positions[0]) % self.ctx  # (ring,)
        taken = (source < T)[None, None, :, None]
        cache.copy_(torch.where(taken, new.index_select(2, source % T), cache))  # (% T: any index)

    def _grouped_sdpa(self, q, step: Step, mask: torch.Tensor) -> torch.Tensor:
        n_rep = self.n_heads // self.n_kv
        T = step.positions.shape[0]
        if step.single:  # q (1, H, 1, D) is (1, n_kv, n_rep, D); the (1, ctx) mask broadcasts
            out = F.scaled_dot_product_attention(q.view(1, self.n_kv, n_rep, self.head_dim),
                                                 self.k_cache, self.v_cache, attn_mask=mask,
                                                 scale=self.scale)
            return merge_heads(out, n_rep).reshape(1, 1, -1)
        q = q.transpose(1, 2).reshape(1, self.n_kv, n_rep * T, self.head_dim)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache,
                                             attn_mask=mask.repeat(n_rep, 1), scale=self.scale)
        # (1, n_kv, n_rep*T, D) -> (1, n_kv, n_rep, T, D) -> (1, T, H*D)
        out = out.view(1, self.n_kv, n_rep, T, self.head_dim).permute(0, 3, 1, 2, 4)
        return merge_heads(out, n_rep).reshape(1, T, -1)


# an int8 KV cache's buffers beside k_cache and v_cache: one per (token, head) row
INT8_CACHE = ("k_cache_scales", "k_cache_zero_points", "v_cache_scales", "v_cache_zero_points")


def quantize_rows(x: torch.Tensor) -> tuple:
    """x (..., D) -> int8 values (..., D), float32 scales and int8 zero points (..., 1): asymmetric,
    one scale per row (per token and head), ExecuTorch's quantized_decomposed per-token ops."""
    x = x.float()
    scales, zeros = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(
        x, torch.int8)
    values = torch.ops.quantized_decomposed.quantize_per_token(x, scales, zeros, -128, 127,
                                                               torch.int8)
    return values, scales.to(torch.float32), zeros.to(torch.int8)


@contextlib.contextmanager
def float_caches(lm: nn.Module):
    """While inside, the eager model `lm`'s int8 KV caches are float caches of the model's dtype,
    zeroed: the model an int8-cache program is measured against (the cache's own cost). The int8
    buffers come back on exit; nothing of this reaches an export."""
    caches = [m for m in lm.modules() if isinstance(m, KVCache) and m.int8]
    saved = [(m.k_cache, m.v_cache) for m in caches]
    for m in caches:
        m.int8 = False
        m.k_cache = torch.zeros(m.k_cache.shape, dtype=m.dtype)
        m.v_cache = torch.zeros(m.v_cache.shape, dtype=m.dtype)
    try:
        yield lm
    finally:
        for m, (k, v) in zip(caches, saved):
            m.int8, m.k_cache, m.v_cache = True, k, v


def merge_heads(out: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Where SDPA gets decomposed (portable, Vulkan, and Core ML in a chain, whose next
    partitioner decomposes what Core ML keeps whole) its output has permuted strides, and the view
    that merges the grouped head dims fails at lowering. One explicit copy makes the merge
    stride-independent; without grouping (n_rep == 1) no merge crosses the permuted dims."""
    return out.clone(memory_format=torch.contiguous_format) if n_rep > 1 else out


def make_step(input_pos: torch.Tensor, T: int, opts: ModelOptions, ropes: dict, dtype) -> Step:
    """The per-call values; `ropes`: rotation kind -> Rope (see Step.ropes)."""
    start_int = mask = None
    single = isinstance(T, int) and T == 1
    # the custom ops, and cache writes of a fixed number of tokens > 1, take the start as an int
    if opts.attention == "custom_ops" or (isinstance(T, int) and T > 1):
        start_int = input_pos[0].item()
        torch._check(start_int >= 0)
        if opts.attention_sink is None:  # a sink program takes any position
            torch._check(start_int + T <= opts.max_context_len)
    positions = input_pos + torch.arange(T, device=input_pos.device)
    if opts.attention == "sdpa":  # shared by every attention layer: (T, ctx), -inf in the future
        future = torch.arange(opts.max_context_len)[None, :] > positions[:, None]
        mask = torch.zeros(future.shape, dtype=dtype).masked_fill(future, float("-inf"))
    keep = (input_pos[0] != 0).to(dtype)
    unbounded = opts.attention_sink is not None  # positions past any table
    return Step(positions=positions, start_int=start_int, keep=keep, mask=mask,
                ropes={kind: r.prepare(positions, dtype, unbounded) for kind, r in ropes.items()},
                single=single, dtype=dtype, tables=ropes)


def head_weight(lm: nn.Module) -> torch.Tensor:
    """The output projection: `lm_head` when the model has one, else the tied embedding."""
    head = getattr(lm, "lm_head", None)
    return head.weight if head is not None else lm.model.embed_tokens.weight


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (shared storage once), except
    that an untied embedding table is only gathered a row at a time."""
    seen, total = set(), 0
    embed = lm.model.embed_tokens.weight
    for name, p in lm.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if head_weight(lm).data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return total


# the buffers a program keeps between calls
STATE = ("k_cache", "v_cache", *INT8_CACHE, "sink_k", "conv_state", "recurrent_state")


def state_report(lm: nn.Module) -> dict:
    """What the program keeps between calls, layer by layer: each KV cache's (a ring buffer's,
    for a sliding window), conv state's and recurrent state's shape, the window, and the bytes;
    the total; and each kind of buffer's dtype (a recurrent state stays float32 whatever the
    model's dtype and recipe)."""
    layers, dtypes = [], {}
    for i, layer in enumerate(lm.model.layers):
        cache = next((m for m in layer.modules() if isinstance(m, KVCache)), None)
        buffers = {n.rsplit(".", 1)[-1]: b for n, b in layer.named_buffers()
                   if n.endswith(STATE)}
        dtypes.update({k: str(b.dtype).removeprefix("torch.") for k, b in buffers.items()})
        layers.append({"layer": i, "window": cache.window if cache else None,
                       **{k: list(b.shape) for k, b in buffers.items()},
                       "bytes": sum(b.numel() * b.element_size() for b in buffers.values())})
    return {"layers": layers, "bytes": sum(row["bytes"] for row in layers), "dtypes": dtypes}


def kv_cache_report(lm: nn.Module) -> dict:
    """The KV caches alone: their dtype, bytes in all, bytes per cached position (every layer's
    keys and values of one position, scales included), and per attention layer its slots (the
    context, or a ring's length), window and buffer shapes. A decode step at depth d reads
    bytes_per_position times min(d, slots) of each layer (benchmark.py's floor)."""
    layers = []
    for i, layer in enumerate(lm.model.layers):
        cache = next((m for m in layer.modules() if isinstance(m, KVCache)), None)
        if cache is None:  # a conv or DeltaNet layer: its state is a fixed size, not a cache
            continue
        kinds = ("k_cache", "v_cache", *INT8_CACHE)
        buffers = {n: b for n, b in cache.named_buffers() if n in kinds}
        size = sum(b.numel() * b.element_size() for b in buffers.values())
        layers.append({"layer": i, "slots": cache.ctx, "window": cache.window,
                       **{n: list(b.shape) for n, b in buffers.items()}, "bytes": size,
                       "bytes_per_position": size // cache.ctx})
    dtype = next((str(c.k_cache.dtype).removeprefix("torch.") for c in lm.modules()
                  if isinstance(c, KVCache)), None)
    return {"dtype": dtype, "bytes": sum(r["bytes"] for r in layers),
            "bytes_per_position": sum(r["bytes_per_position"] for r in layers), "layers": layers}


def separate_tied_head(lm: nn.Module) -> None:
    """Give a tied head its own Parameter over the embedding's storage (no copy). XNNPACK puts a
    linear whose weight the (undelegated) embedding also reads into a partition of its own; as
    distinct parameters, the head joins the final norm's partition and the program is no larger."""
    if getattr(lm, "lm_head", None) is None:
        embed = lm.model.embed_tokens.weight
        lm.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        lm.lm_head.weight = nn.Parameter(embed.detach(), requires_grad=False)


@contextlib.contextmanager
def every_position(lm: nn.Module):
    """While inside, the eager model `lm` returns the logits of every token of a call, (1, T,
    vocab), not the last token's: a sequence's logits in one call instead of one call per token.
    Exports never set it: it is read when the graph is traced and leaves no trace in it."""
    lm.every_position = True
    try:
        yield lm
    finally:
        del lm.every_position


def run_decoder(lm: nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor, final_norm: nn.Module,
                head: torch.Tensor) -> torch.Tensor:
    """The top of every architecture: embed, every layer, final norm and head on the last token.
    Only the last token's logits leave the program, so the last layer's feed-forward runs on that
    token alone (its mixer still sees every token: they fill the caches). `lm` has `.opts`,
    `.model` with `embed_tokens` and `layers`, whose forward takes `last_only`, and its rotary
    tables as `.ropes` (kind -> Rope) or one `.rope`."""
    x = lm.model.embed_tokens(tokens)  # (1, T, hidden)
    if getattr(lm, "embed_scale", None) is not None:  # Gemma's sqrt(hidden), Granite's multiplier
        x = x * lm.embed_scale
    ropes = getattr(lm, "ropes", None) or {FULL: lm.rope}
    step = make_step(input_pos, tokens.shape[1], lm.opts, ropes, x.dtype)
    *layers, last = lm.model.layers
    for layer in layers:
        x = layer(x, step)
    if getattr(lm, "every_position", False):  # an eager run's every logit (verification)
        x = last(x, step)
    else:  # a select, not a slice: XNNPACK leaves either out, and after a select the
        # feed-forward, final norm and head share one delegate; a one-token step drops nothing
        x = last(x, step, last_only=True) if not step.single else last(x, step)[:, -1, :]
    logits = F.linear(final_norm(x), head)  # (1, vocab); (1, T, vocab) at every position
    finish = getattr(lm, "finish_logits", None)  # Granite's scaling, Gemma's soft cap
    return finish(logits) if finish is not None else logits
