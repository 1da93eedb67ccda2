"""Layers shared by the architectures: RMSNorm, rotary embedding, the per-call `Step`, the causal
conv's state, and the top of every decoder (`run_decoder`); the KV cache is cache.py's.

These follow transformers' math exactly; what differs is how they are written, because the way a
model is written decides what a backend receives (see ../shared/reference/lowering-findings.md):
- RMSNorm has three spellings of the same formula, chosen by the backend (`norm`).
- RoPE gathers precomputed cos/sin rows at the step's positions (or, for a program with attention
  sinks, computes them from the positions) and rotates half the head with a signed permutation
  matrix (one linear) instead of slices and a cat.
- `Step` holds what every layer of a call shares: positions, the causal mask, the rotations, and
  for ring buffers the slots a call writes and the mask of what each query sees.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .pending import derive


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
        sd[f"{name}.weight"] = derive(lambda t, w: t.float() * w, sd[f"{name}.weight"], w)


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
    sd[f"{prefix}.qk_proj.weight"] = derive(lambda q, k: torch.cat([q, k]), q, k)
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
        if len(sd[key].shape) == 3:
            sd[key] = derive(lambda w: w.reshape(w.shape[0], w.shape[-1]).T.contiguous(), sd[key])


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


def weight_bytes(lm: nn.Module, size: Callable = lambda t: t.numel() * t.element_size()) -> int:
    """Bytes of weights one decode step reads (`size` torch.Tensor.numel: parameters): every
    parameter once (shared storage once), except that an untied embedding table is only gathered
    a row at a time and a mixture-of-experts block's experts count as the k a token chooses."""
    seen, total = set(), 0
    embed = lm.model.embed_tokens.weight
    for name, p in lm.named_parameters():
        if storage(p) in seen:
            continue
        seen.add(storage(p))
        total += size(p)
    if storage(head_weight(lm)) != storage(embed):
        total -= size(embed) * (embed.shape[0] - 1) // embed.shape[0]
    for block in lm.modules():
        if hasattr(block, "expert_tensors"):  # a sparse block: a token reads k experts of E
            experts, share = block.expert_tensors()
            every = sum(size(t) for t in experts)
            total += int(every * share) - (every if block.bits is None else 0)
    return total


def storage(p: torch.Tensor) -> int:
    """What tells shared weights apart: their storage's address, or for a Parameter still on the
    meta device, which has none, what it will be read from (pending.Pending, which a tied head
    shares with its table) or the Parameter itself (deferred experts, moe.Experts.defer)."""
    return p.data_ptr() or id(getattr(p, "pending", None) or p)


def separate_tied_head(lm: nn.Module) -> None:
    """Give a tied head its own Parameter over the embedding's storage (no copy). XNNPACK puts a
    linear whose weight the (undelegated) embedding also reads into a partition of its own; as
    distinct parameters, the head joins the final norm's partition and the program is no larger."""
    if getattr(lm, "lm_head", None) is None:
        embed = lm.model.embed_tokens.weight
        lm.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        lm.lm_head.weight = nn.Parameter(embed.detach(), requires_grad=False)
        if getattr(embed, "pending", None) is not None:  # both read from it (pending.Pending)
            lm.lm_head.weight.pending = embed.pending


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
