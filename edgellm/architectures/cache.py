"""The KV cache of an attention layer, attention included: a static cache of the whole context,
a ring buffer for a sliding window, sink slots ahead of a ring for attention sinks; in the model's
dtype or in int8 (ExecuTorch's quantized cache). And what a program keeps between calls, as the
report gives it (`state_report`, `kv_cache_report`).

How a call's positions map to slots and which slots a query sees is `layers.Step`'s
(`ring_slots`, `ring_mask`, `sink_rotation`), shared by every layer of a call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .layers import FULL, ModelOptions, Step, heads_axis, to_heads, write_at


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
            # the runtime's kernel takes an fp32 mask only (op_sdpa.cpp), whatever q's dtype;
            # eager's takes fp16 too, so only a program would fail
            if mask.dtype != torch.float32:
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
    bytes_per_position times min(d, slots) of each layer (run/benchmark.py's floor)."""
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
