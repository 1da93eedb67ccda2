"""A source's 4-bit grids, kept: found in the dequantized weights, rebuilt as exactly its 4-bit
codes on a symmetric grid plus, where the grid is offset, a correction per block.

A GGUF's Q4_0 / Q4_1 blocks of 32 (and Q4_K's sub-blocks of 32) hold at most 16 evenly spaced
levels. torchao's `SYMMETRIC_NO_CLIPPING_ERR` scale (max(-min/8, max/7)) is exactly the step of
a symmetric -8..7 grid, so `quantize_` with the `affine` algorithm (not HQQ, which would move it)
reproduces the codes. An offset grid (Q4_1's and Q4_K's float minimum, which integer zero points
cannot hold, and XNNPACK's 4-bit weights have none) becomes a `GridLinear`: the codes' linear plus
`offset(sums(x))`, two small linears XNNPACK takes (it has no `sum`); `offset` takes 8 bits per
output channel (the recipe's activations: dynamic ones on XNNPACK), a quarter bit a weight where
fp32 offsets cost one, which puts each offset within 1/254 of its row's largest. A table on such
a grid keeps it as ExecuTorch's 4-bit embedding kernel reads it, whose zero points are float
(`grid_table`).

A source tensor on no 4-bit grid (a GGUF's 5-bit, 3-bit and IQ2/IQ3 types; IQ4's are held at
8 bits instead, recipes.UNGRIDDED_4BIT) is put on one first:
requantized by the `gguf` package's own Q4_1 quantizer (`onto_q4_1`: a step and a minimum per
block of 32, llama.cpp's reference), which loses less than a symmetric 4-bit grid (BENCHMARKS.md,
Tensors on no 4-bit grid), and then kept as a Q4_1 tensor is.
"""

from __future__ import annotations

import torch
from torch import nn

GRID_BLOCK = 32  # GGUF's Q4_0 and Q4_1 blocks, and Q4_K's sub-blocks
GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")
REGRID_TYPE = "Q4_1"  # the grid a source tensor on none is requantized onto


def packed_bytes(weight, bits: int, group: int) -> int:
    """Bytes of a quantized weight: its codes and one fp32 scale per group (per row: group 0)."""
    rows, cols = weight.shape
    return rows * cols * bits // 8 + rows * (1 if group == 0 else cols // group) * 4


def block_grid(weight, block: int = GRID_BLOCK, tol: float = 1e-3):
    """(codes, offsets) when every block of `block` input columns of `weight` (out, in) holds at
    most 16 evenly spaced levels offset + step * k, k in -8..7: codes = weight - offset (out, in),
    offsets (out, in / block), zero where the grid runs through zero. Q4_1 blocks span their
    minimum to maximum in 15 steps; Q4_0 blocks step max|w| / 8 through zero; Q4_K's sub-blocks
    are Q4_1's with a searched scale, whose codes need not reach both ends: fewer steps. Else
    None."""
    rows, cols = weight.shape
    if cols % block:
        return None
    b = weight.detach().float().view(rows, cols // block, block)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)

    def levels(step, origin):  # (rows, blocks) whether every value is origin + step * integer
        k = (b - origin) / torch.where(step > 0, step, torch.ones_like(step))
        return ((k - k.round()).abs() <= tol).all(-1), k

    step0 = torch.maximum(-lo, hi) / 8  # Q4_0-like: zero is a level, max|w| is level -8 or 8
    fits0, k0 = levels(step0, torch.zeros_like(lo))
    top = k0.amax(-1) > 7.5
    fits0 &= ~(top & (k0.amin(-1) < -7.5))  # -8..8 are 17 levels
    step1 = (hi - lo) / 15  # Q4_1-like: lo is level -8, hi level 7
    fits1, _ = levels(step1, lo)
    for span in range(14, 0, -1):  # Q4_K-like: lo to hi in fewer steps (a finer grid fits too)
        if bool((fits0 | fits1).all()):
            break
        fits, _ = levels((hi - lo) / span, lo)
        fits &= ~(fits0 | fits1)
        step1 = torch.where(fits[..., None], (hi - lo) / span, step1)
        fits1 |= fits
    if not bool((fits0 | fits1).all()):
        return None
    offsets = torch.where(fits0, torch.where(top, step0[..., 0], 0.0), (lo + 8 * step1)[..., 0])
    return (b - offsets[..., None]).view(rows, cols), offsets


def through_gguf(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` (rows a multiple of the type's block) through the gguf package's quantizer for
    storage type `kind` ("Q4_1", "Q5_0", ...) and back, in its dtype: what a file of that type
    holds."""
    import gguf
    from gguf.quants import dequantize, quantize

    ggml = gguf.GGMLQuantizationType[kind]
    values = weight.detach().float().numpy()
    return torch.from_numpy(dequantize(quantize(values, ggml), ggml).reshape(values.shape)
                            ).to(weight.dtype)


def onto_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in; in a multiple of GRID_BLOCK) on Q4_1's grid, as llama.cpp's reference
    quantizer puts it: every block of 32 on 16 levels from its minimum to its maximum."""
    return through_gguf(weight, REGRID_TYPE)


class GridLinear(nn.Module):
    """A linear whose weight is 4-bit codes on a symmetric grid plus an offset per block of its
    input (a GGUF Q4_1's minimum): y = x @ codes.T + (x @ sums.T) @ offsets.T, three linears
    XNNPACK takes whole (it has no `sum`). `sums` (in / block, in) is a fixed 0/1 matrix shared
    by every linear of the same input width; `keep_grids` builds these and quantizes `linear`
    (the codes exactly) and `offset` (8 bits per output channel)."""

    def __init__(self, linear: nn.Linear, codes: torch.Tensor, offsets: torch.Tensor,
                 sums: nn.Parameter):
        super().__init__()
        dtype = linear.weight.dtype
        self.linear = nn.Linear(codes.shape[1], codes.shape[0], bias=linear.bias is not None,
                                device="meta")
        self.linear.weight = nn.Parameter(codes.to(dtype), requires_grad=False)
        if linear.bias is not None:
            self.linear.bias = linear.bias
        self.sums = nn.Linear(sums.shape[1], sums.shape[0], bias=False, device="meta")
        self.sums.weight = sums
        self.offset = nn.Linear(offsets.shape[1], offsets.shape[0], bias=False, device="meta")
        self.offset.weight = nn.Parameter(offsets.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return self.linear(x) + self.offset(self.sums(x))


def keep_grids(model, candidates, dynamic: bool, regrid=(),
               costs: dict | None = None) -> list[tuple[str, int]]:
    """Replace every linear of `candidates` (those the source stored as Q4_0 / Q4_1 / Q4_K)
    whose blocks lie on a grid by its 4-bit codes (a GridLinear where the grid is offset),
    after those of `regrid` (stored on no 4-bit grid) are requantized onto Q4_1's (`onto_q4_1`).
    Returns (name, bytes saved) of each one kept; the others are left as they are. `costs`
    gets each kept one's (signal, noise) against the source's weight (cost.cost)."""
    from torchao.quantization import quantize_

    from ..architectures.loading import read_pending
    from .cost import cost, sample
    from .recipes import torchao_config

    exact, kept, sums = torchao_config(4, GRID_BLOCK, dynamic, "affine", exact=True), [], {}
    offsets_config = torchao_config(8, 0, dynamic, "affine")
    candidates, regrid = set(candidates) | set(regrid), set(regrid)
    # by name: a list of the modules would keep each replaced linear's float weight alive
    linears = [n for n, m in model.named_modules() if n in candidates and isinstance(m, nn.Linear)]
    for fqn in linears:
        module = model.get_submodule(fqn)
        read_pending(module)
        before = sample(module.weight)
        if fqn in regrid:
            module.weight.data = onto_q4_1(module.weight)
        found = block_grid(module.weight)
        offset = found is not None and bool(found[1].any())
        if found is None or offset and fqn == "lm_head":  # the head is applied as a weight
            continue
        codes, offsets = found
        size = module.weight.element_size()
        kept.append((fqn, module.weight.numel() * size - packed_bytes(codes, 4, GRID_BLOCK)
                     - (packed_bytes(offsets, 8, 0) if offset else 0)))
        if offset:
            width = codes.shape[1]
            if width not in sums:
                eye = torch.eye(width // GRID_BLOCK).repeat_interleave(GRID_BLOCK, dim=1)
                sums[width] = nn.Parameter(eye.to(module.weight.dtype), requires_grad=False)
            parent, _, name = fqn.rpartition(".")
            module = GridLinear(module, codes, offsets, sums[width])
            setattr(model.get_submodule(parent), name, module)
            quantize_(module.offset, offsets_config, filter_fn=lambda m, f: True)
            module = module.linear
        quantize_(module, exact, filter_fn=lambda m, f: isinstance(m, nn.Linear))
        if costs is not None:
            costs[fqn] = cost(before, model.get_submodule(fqn))
    return kept


def grid_table(weight):
    """A 4-bit table (vocab, dim) whose rows lie on a grid per block of GRID_BLOCK as
    torchao's 4-bit tensor with the grid's step as scale and its offset as a float zero point
    (ExecuTorch's `embedding_4bit` computes (code - zero point) * scale), so that every value is
    the source's; None when the rows lie on no such grid."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    found = block_grid(weight)
    if found is None:
        return None
    codes, offsets = found
    rows, cols = codes.shape
    blocks = codes.view(rows, cols // GRID_BLOCK, GRID_BLOCK)
    step = torch.maximum(-blocks.amin(-1) / 8, blocks.amax(-1) / 7)  # as block_grid's codes
    step = torch.where(step > 0, step, torch.ones_like(step))  # a block of one value: code 0
    qdata = (blocks / step[..., None]).round().clamp(-8, 7).to(torch.int8).view(rows, cols)
    dtype = weight.dtype
    return IntxUnpackedToInt8Tensor(qdata, step.to(dtype), (-offsets / step).to(dtype), torch.int4,
                                    (1, GRID_BLOCK), dtype, None)
