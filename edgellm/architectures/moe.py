"""Mixture-of-experts feed-forwards (LFM2-MoE, Qwen3-MoE): a router picks each token's top-k
experts, each a SwiGLU feed-forward, and their outputs are summed with the routing weights.

Routing is transformers' exactly (`Routing`): sigmoid scores with a per-expert bias that shifts
only the choice (LFM2-MoE) or softmax over every expert (Qwen3-MoE); the chosen weights
normalised to sum 1 where the config says so (`norm_topk_prob`), then times
`routed_scaling_factor`. Formulations of the same sum (config `experts` picks among the last
three for a recipe):
- "gather" (float experts): the chosen experts' weights gathered per token (`W[idx]`) and
  multiplied as one batched matmul; a decode step reads k experts of E.
- "op" (4- or 8-bit experts, once quantize/experts.py has packed them): ExecuTorch's
  `llama::quantized_moe_ffn`, which routes, runs the chosen experts from torchao-packed blobs and
  sums, in one CPU kernel beside the delegates. The op always normalises the chosen weights;
  where the model does not, the program multiplies by their sum (routed again, in float).
- "chosen" (`Expert` modules of the recipe, `use_each`; then a delegate apiece,
  `use_delegates`, lower.lower_experts): per expert a `torch.cond` on whether any token of the
  call chose it, whose true branch calls that expert's delegate on the call's tokens scaled by
  their routing weights (zero for tokens that did not choose it). ExecuTorch runs the cond as a
  jump, so a decode step runs, and reads, the k chosen experts only.
- "every" (two linears of the recipe, `use_linears`): every expert on every token, the hidden
  scaled by the routing weights; reads all E experts.

Parameters keep transformers' module names: `gate.weight` (E, D) is the router (a plain
Parameter, so a linear recipe leaves it float: the choice of experts is where rounding costs
most), `experts.gate_up_proj` (E, 2F, D) and `experts.down_proj` (E, D, F) the experts, stacked
from the checkpoint's one tensor per expert when a folder is read (`stack_experts`, through
`Architecture.merge`), as transformers' loader does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError


@dataclass(frozen=True)
class Routing:
    """How a family routes: "sigmoid" or "softmax" scores; the chosen weights normalised (with
    `eps` in the divisor, as the family writes it) and scaled."""

    score: str
    experts: int
    top_k: int
    normalise: bool
    scale: float = 1.0
    eps: float = 0.0
    bias: bool = False  # a per-expert bias added to the scores for the choice only


class Router(nn.Module):
    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class Deferred:
    """A stacked experts tensor not read yet: `read(e)` gives expert e's row (from a checkpoint's
    memory map: a folder's tensors concatenated, a GGUF's slice dequantized), `shape` and
    `dtype` are known before. `to(dtype)` reads every row into one new tensor of that dtype (no
    stacked copy in the checkpoint's dtype on the way)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, read: Callable[[int], torch.Tensor]):
        self.shape, self.dtype, self.read = torch.Size(shape), dtype, read

    @classmethod
    def stack(cls, rows: list[list[torch.Tensor]]) -> "Deferred":
        """Per expert, the tensors that concatenate into its row."""
        first = rows[0]
        shape = (len(rows), sum(t.shape[0] for t in first), *first[0].shape[1:])
        return cls(shape, first[0].dtype, lambda e: torch.cat(rows[e]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> torch.Tensor:
        """Expert e's row alone, in the checkpoint's dtype."""
        return self.read(e)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype)
        for e in range(len(self)):
            out[e].copy_(self[e])
        return out

    def float(self) -> torch.Tensor:
        return self.to(torch.float32)


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.deferred = {}  # name -> Deferred, for Parameters left on the meta device at load

    def defer(self, name: str, value: Deferred, dtype: torch.dtype) -> None:
        """Leave `name` in the checkpoint until read (loading.load_weights with defer): a meta
        Parameter of its shape and dtype stands in, so sizes are counted as for a loaded one."""
        setattr(self, name, nn.Parameter(torch.empty(value.shape, dtype=dtype, device="meta"),
                                         requires_grad=False))
        self.deferred[name] = value

    def read(self, name: str) -> torch.Tensor:
        """The values of `name`, read from the checkpoint now if they were deferred."""
        param = getattr(self, name)
        return self.deferred[name].to(param.dtype) if name in self.deferred else param.detach()

    def rows(self, name: str):
        """`name` an expert at a time, (N, K) each: a deferred one read from the checkpoint one
        expert at a time, in the Parameter's dtype."""
        param = getattr(self, name)
        if name not in self.deferred:
            return iter(param.detach())
        stack = self.deferred[name]
        return (stack[e].to(param.dtype) for e in range(len(stack)))

    def load_deferred(self) -> None:
        """Every deferred Parameter read and kept (for a consumer of the float experts)."""
        for name in list(self.deferred):
            setattr(self, name, nn.Parameter(self.read(name), requires_grad=False))
            del self.deferred[name]


class SparseMoE(nn.Module):
    def __init__(self, routing: Routing, hidden: int, width: int):
        super().__init__()
        self.routing, self.hidden, self.width = routing, hidden, width
        self.gate = Router(routing.experts, hidden)
        self.experts = Experts(routing.experts, hidden, width)
        if routing.bias:  # a buffer in transformers; a Parameter here so that it loads by name
            self.expert_bias = nn.Parameter(torch.empty(routing.experts), requires_grad=False)
        self.bits = None  # 4 or 8 once use_packed gave the experts to the op
        self.group = None
        self.reads_every = False  # every expert will run (use_linears): a token reads them all
        self.delegates = []  # a LoweredBackendModule per expert once use_delegates gave them
        self.pending = None  # (bits, group, dynamic) of `--experts chosen` not quantized yet

    def route(self, x):
        """x (N, D) -> the chosen experts' weights (N, k) and indices (N, k), as transformers."""
        r = self.routing
        logits = F.linear(x, self.gate.weight)  # (N, E)
        if r.score == "sigmoid":
            scores = logits.sigmoid()
            pick = scores + self.expert_bias.float() if r.bias else scores
            idx = torch.topk(pick, r.top_k, dim=-1).indices
            weights = torch.gather(scores, -1, idx)
        else:
            weights, idx = torch.topk(torch.softmax(logits.float(), dim=-1), r.top_k, dim=-1)
        if r.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + r.eps)
        return (weights * r.scale if r.scale != 1.0 else weights).to(x.dtype), idx

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.hidden)  # (N, D): a call's tokens, or the last one
        if self.bits:
            out = self._op(x)
        elif hasattr(self, "up"):
            out = self._every(x)
        elif self.delegates or hasattr(self, "each"):
            out = self._chosen(x)
        else:
            out = self._gather(x)
        return out.view(shape)

    def _chosen(self, x):
        """Each expert run only when a token of the call chose it, on the call's tokens, scaled by
        their routing weights (zero where a token did not choose it): the gathered sum. Eager,
        by Python's `if` on the modules (`each`); exported, by `torch.cond` on their delegates."""
        weights, idx = self.route(x)
        dense = x.new_zeros(x.shape[0], self.routing.experts).scatter(1, idx, weights)
        if self.delegates and not torch.compiler.is_exporting():
            raise RuntimeError("the experts are delegates (lower.lower_experts): the exported "
                               "program runs them, eager Python cannot")
        out = torch.zeros_like(x)
        for e in range(self.routing.experts):
            w, chose = dense[:, e:e + 1], (idx == e).any()
            if self.delegates:  # the operator itself: torch.cond would compile each with dynamo
                branch = functools.partial(_run, self.delegates[e])
                out = out + torch.ops.higher_order.cond(chose, branch, _nothing, (x, w))
            elif chose:
                out = out + self.each[e](x, w)
        return out

    def _every(self, x):
        """Every expert at once: gate and up as one linear (D -> E x 2F), the hidden scaled by
        the routing weights (zero for the experts not chosen), down as one linear (E x F -> D):
        the gathered sum, with the experts in two linears a delegate takes whole."""
        weights, idx = self.route(x)
        e, f = self.routing.experts, self.width
        dense = x.new_zeros(x.shape[0], e).scatter(1, idx, weights)  # (N, E)
        gate, lin = self.up(x).view(-1, e, 2 * f).split(f, dim=-1)
        h = F.silu(gate) * lin * dense.unsqueeze(-1)  # (N, E, F)
        return self.down(h.reshape(-1, e * f))

    def _gather(self, x):
        if self.experts.deferred:
            raise RuntimeError("the experts are still in the checkpoint (deferred at load for a "
                               "recipe): Experts.load_deferred() reads them")
        weights, idx = self.route(x)
        up = self.experts.gate_up_proj[idx]  # (N, k, 2F, D): the chosen experts only
        h = (up @ x[:, None, :, None]).squeeze(-1)  # (N, k, 2F)
        gate, lin = h.split(self.width, dim=-1)
        h = F.silu(gate) * lin  # (N, k, F)
        y = (self.experts.down_proj[idx] @ h.unsqueeze(-1)).squeeze(-1)  # (N, k, D)
        return (y * weights.unsqueeze(-1)).sum(dim=1)

    def _op(self, x):
        r = self.routing
        bias = self.expert_bias.float() if r.bias else x.new_zeros(0, dtype=torch.float32)
        out = torch.ops.llama.quantized_moe_ffn(
            x.float(), self.gate.weight.float(), bias, self.packed_w13, self.packed_w2, r.top_k,
            r.experts, self.width, self.hidden, self.group, self.bits, r.score,
            r.scale if r.normalise else 1.0)
        if not r.normalise:  # the op normalised the chosen weights: times their (scaled) sum
            weights, _ = self.route(x.float())
            out = out * weights.sum(dim=-1, keepdim=True)
        return out.to(x.dtype)

    def use_packed(self, w13: torch.Tensor, w2: torch.Tensor, bits: int, group: int) -> None:
        """Run the experts through `llama::quantized_moe_ffn` from torchao-packed blobs (E, bytes)
        (quantize/experts.py), dropping the float ones."""
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers it)

        del self.experts
        self.register_buffer("packed_w13", w13)
        self.register_buffer("packed_w2", w2)
        self.bits, self.group = bits, group

    def use_linears(self, up: nn.Module, down: nn.Module) -> None:
        """Run every expert as two linears (`_every`; quantize/experts.py makes them from the
        experts, `every_expert_linears`), dropping the stacked experts."""
        del self.experts
        self.up, self.down = up, down

    def use_each(self, experts: nn.ModuleList) -> None:
        """Run the chosen experts as modules of their own (`_chosen`; quantize/experts.py makes
        them, `Expert.of`), dropping the stacked experts."""
        del self.experts
        self.each = experts

    def use_delegates(self, lowered: list) -> None:
        """Run each expert through its delegate (lower.lower_experts), dropping the modules."""
        del self.each
        self.delegates = lowered

    def expert_tensors(self) -> tuple[list, float]:
        """The experts' tensors (float Parameters, packed buffers, the two linears' weights or
        each expert's once quantized) and the share of them a token reads (k / E; all of them
        where every expert runs, `reads_every`)."""
        if hasattr(self, "up"):
            return [self.up.weight, self.down.weight], 1.0
        if hasattr(self, "each"):
            return ([m.weight for e in self.each for m in (e.gate, e.up, e.down)],
                    self.routing.top_k / self.routing.experts)
        tensors = ([self.packed_w13, self.packed_w2] if self.bits else
                   [self.experts.gate_up_proj, self.experts.down_proj])
        return tensors, 1.0 if self.reads_every else self.routing.top_k / self.routing.experts


def _run(lowered, x, w):
    return torch.ops.higher_order.executorch_call_delegate(lowered, x, w)[0]


def _nothing(x, w):
    return torch.zeros_like(x)


class Expert(nn.Module):
    """One expert, its output times its routing weight (N, 1): the unit `--experts chosen` lowers
    to a delegate of its own (three linears a delegate takes whole)."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    @classmethod
    def of(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "Expert":
        """From an expert's rows: gate_up (2F, D), gate first; down (D, F)."""
        f = down.shape[1]
        return cls(*(_linear(w) for w in (gate_up[:f], gate_up[f:], down)))

    def forward(self, x, w):
        return self.down(F.silu(self.gate(x)) * self.up(x)) * w


def _linear(weight: torch.Tensor) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    return out


def every_expert_linears(block: SparseMoE) -> tuple[nn.Linear, nn.Linear]:
    """The block's float experts as `_every`'s two linears: gate_up_proj (E, 2F, D) as one
    (E x 2F, D) weight (a view), down_proj (E, D, F) as one (D, E x F) (a copy), read from the
    checkpoint where they were deferred."""
    e, f, d = block.routing.experts, block.width, block.hidden
    return (_linear(block.experts.read("gate_up_proj").reshape(e * 2 * f, d)),
            _linear(block.experts.read("down_proj").permute(1, 0, 2).reshape(d, e * f)))


def quantizable(module: SparseMoE, group: int) -> str | None:
    """Why `llama::quantized_moe_ffn` cannot take these experts at `group`, or None."""
    if not group:
        return ("the op's experts are quantized per group; per-channel (group 0) has no "
                "group the hidden and expert widths share")
    if group % 16:
        return f"group_size {group} is no multiple of 16 (torchao's packed layout)"
    bad = [f"{name} {width}" for name, width in (("hidden size", module.hidden),
                                                 ("expert width", module.width)) if width % group]
    return f"group_size {group} does not divide the {' and the '.join(bad)}" if bad else None


def stack_experts(sd: dict, prefix: str, experts: int, names: tuple[str, str, str]) -> None:
    """The checkpoint's experts, one tensor each (`prefix.experts.N.<gate>.weight`, up, down as
    `names`), stacked into `prefix.experts.gate_up_proj` (E, 2F, D) and `down_proj` (E, D, F),
    `Deferred` until read; a state dict already stacked is left as it is."""
    gate, up, down = names
    keys = [[f"{prefix}.experts.{e}.{n}.weight" for n in names] for e in range(experts)]
    found = [k for row in keys for k in row if k in sd]
    if not found:
        return
    missing = [k for row in keys for k in row if k not in sd]
    if missing:
        raise InputError(f"Checkpoint lacks {', '.join(missing[:4])}"
                         f"{' and more' if len(missing) > 4 else ''}: the config has {experts} "
                         "experts per layer. Check that the weights and config.json come from "
                         "the same model.")
    sd[f"{prefix}.experts.gate_up_proj"] = Deferred.stack([[sd.pop(g), sd.pop(u)]
                                                           for g, u, _ in keys])
    sd[f"{prefix}.experts.down_proj"] = Deferred.stack([[sd.pop(d)] for _, _, d in keys])


def fold_into_experts(sd: dict, norm: str, prefix: str) -> None:
    """layers.fold_norm for a sparse block: the norm before it feeds the router and every
    expert's gate and up rows, so its weight folds into their input columns (exact in float)."""
    from .layers import fold_norm

    experts = f"{prefix}.experts.gate_up_proj"
    if f"{norm}.weight" in sd and experts in sd:
        sd[experts] = sd[experts].float() * sd[f"{norm}.weight"].float()  # (E, 2F, D) * (D,)
    fold_norm(sd, norm, [f"{prefix}.gate"])  # the router, and the norm's weight dropped
