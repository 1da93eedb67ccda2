"""What quantizing a weight cost: the SQNR of what the quantized module multiplies by (or looks
up) against the weight it replaced. Every row is quantized on its own (per channel, or in
groups and blocks along the input), so evenly spread rows estimate the whole tensor: at most
SAMPLED_ROWS of them are copied before quantization, and a 262,144-row table costs no float copy
of itself."""

from __future__ import annotations

import math

import torch

SAMPLED_ROWS = 2048  # in spans of SPAN rows, evenly spread over the tensor
SPAN = 64


def spans(rows: int) -> list[tuple[int, int]]:
    """(start, end) of the rows a tensor's cost is measured on: all of them up to SAMPLED_ROWS."""
    if rows <= SAMPLED_ROWS:
        return [(0, rows)]
    n = SAMPLED_ROWS // SPAN
    return [(s, s + SPAN) for s in (i * (rows - SPAN) // (n - 1) for i in range(n))]


def weight_rows(module, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows start..end of what `module` (a linear, a table, or grid.GridLinear) multiplies by:
    its float weight, torchao's dequantized one, plus a GridLinear's per-block offsets."""
    if hasattr(module, "offset"):  # a GridLinear: codes plus an offset per block of the input
        offsets = weight_rows(module.offset, start, end)
        block = module.sums.weight.shape[1] // module.sums.weight.shape[0]
        return weight_rows(module.linear, start, end) + offsets.repeat_interleave(block, dim=1)
    rows = module.weight[start:end]
    return (rows.dequantize() if hasattr(rows, "qdata") else rows).detach()


def sample(weight: torch.Tensor) -> list:
    """The rows a cost is measured on, copied before the weight is quantized (read from the
    checkpoint where the weight is still there: pending.Pending.rows)."""
    rows = float_rows(weight)
    return [(a, b, rows(a, b).detach().float().clone()) for a, b in spans(weight.shape[0])]


def float_rows(weight: torch.Tensor):
    """(start, end) -> those rows of `weight` in float: its own, or read from the checkpoint
    where it is still there (a meta Parameter with `pending`, read by rows)."""
    pending = getattr(weight, "pending", None)
    return pending.rows if pending is not None else lambda a, b: weight[a:b]


def cost(sampled: list, module) -> tuple[float, float]:
    """(signal, noise) energies of `module`'s quantized rows against `sampled` (sample())."""
    signal = noise = 0.0
    for a, b, before in sampled:  # summed in float64, a span at a time
        before = before.double()
        signal += float(before.square().sum())
        noise += float((weight_rows(module, a, b).double() - before).square().sum())
    return signal, noise


def sqnr_db(signal: float, noise: float) -> float | None:
    """10 log10(signal / noise) to 0.1 dB; None where nothing changed (JSON has no infinity)."""
    return None if noise == 0 else round(10 * math.log10(max(signal, 1e-300) / noise), 1)
