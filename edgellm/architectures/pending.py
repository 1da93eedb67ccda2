"""Weights not read yet: a `Pending` names a checkpoint's tensor (a GGUF matrix, still quantized in
the mapped file) and reads it when asked; `derive` computes on tensors and pending ones alike, so
a model's load-time hooks (a fused tensor split, a norm folded in, two tensors joined) leave a
pending weight pending (loading.py says who reads them, and when)."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import InputError


class Pending:
    """A weight not read yet: `read()` gives it (a GGUF matrix dequantized from the mapped file),
    of the `shape` and `dtype` known before; `to(dtype)` reads it in that dtype; `rows(a, b)`
    its rows a..b alone, where the source can (`read_rows`: a GGUF's table; `by_rows`), so that
    a 262,144-row table is never whole in float."""

    def __init__(self, name: str, shape: tuple, dtype: torch.dtype, read,
                 read_rows: Callable[[int, int], torch.Tensor] | None = None):
        self.name, self.shape, self.dtype, self._read = name, torch.Size(shape), dtype, read
        self._rows = read_rows

    @property
    def by_rows(self) -> bool:
        """Whether `rows` reads rows alone (else a caller reads the whole once)."""
        return self._rows is not None

    def rows(self, start: int, end: int) -> torch.Tensor:
        if self._rows is None:
            raise ValueError(f"{self.name} is read whole, not by rows: read_pending it first")
        return self._rows(start, end)

    def read(self) -> torch.Tensor:
        out = self._read()
        if out.shape != self.shape:
            raise InputError(f"Checkpoint tensor {self.name} reads as shape {tuple(out.shape)} "
                             f"where {tuple(self.shape)} was expected: the file is damaged.")
        return out

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.read().to(dtype)

    def float(self) -> torch.Tensor:
        return self.to(torch.float32)


def derive(fn: Callable[..., torch.Tensor], *values) -> torch.Tensor | Pending:
    """`fn(*values)` now when no value is pending; else a `Pending` of that result, read when it
    is (its shape and dtype from `fn` on meta tensors). A result that views a larger tensor (a
    part of a split) is copied when read, so that it does not hold the whole."""
    if not any(isinstance(v, Pending) for v in values):
        return fn(*values)
    meta = fn(*(torch.empty(v.shape, dtype=v.dtype, device="meta")
                if isinstance(v, (Pending, torch.Tensor)) else v for v in values))

    def read() -> torch.Tensor:
        out = fn(*(v.read() if isinstance(v, Pending) else v for v in values))
        return out.clone() if out.untyped_storage().nbytes() > out.nbytes else out

    name = " + ".join(v.name for v in values if isinstance(v, Pending))
    return Pending(name, meta.shape, meta.dtype, read)
