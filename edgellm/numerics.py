"""Comparing logits: one place for the figures every check reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    mean_abs: float
    sqnr_db: float  # signal-to-quantization-noise ratio of `actual` against `expected`
    argmax_agree: float  # fraction of rows whose argmax matches

    def __str__(self) -> str:
        return (f"max abs err {self.max_abs:.3g}, mean abs err {self.mean_abs:.3g}, "
                f"SQNR {self.sqnr_db:.1f} dB, argmax agreement {self.argmax_agree:.3f}")


def compare(actual: torch.Tensor, expected: torch.Tensor) -> Comparison:
    """Compare two logit tensors of the same shape (..., vocab), in float64."""
    a, e = actual.detach().double().reshape(-1, actual.shape[-1]), \
        expected.detach().double().reshape(-1, expected.shape[-1])
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    diff = (a - e).abs()
    noise = float(((a - e) ** 2).sum())
    signal = float((e ** 2).sum())
    sqnr = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)
    agree = float((a.argmax(-1) == e.argmax(-1)).double().mean())
    return Comparison(float(diff.max()), float(diff.mean()), sqnr, agree)
