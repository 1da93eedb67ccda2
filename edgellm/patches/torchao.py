"""torchao 0.18's HQQ scale search, run a cache-sized block of rows at a time.

`_choose_qparams_and_quantize_scale_only_hqq` (every recipe's scale search, as export_llm's
`use_hqq`) iterates up to twenty times over the whole weight, and each iteration makes several
weight-sized temporaries (the quotient, its rounding, the clamp, two products): on a 3072 x 16384
linear that is 200 MB per temporary and a hundred-odd passes through memory per weight: 28.2 s
a layer of Phi-4-mini, some 15 minutes for its 32 layers (bench/hqq_blocks.py).

Each group's scale follows its own trajectory: an iteration reads only that group's weights and
scale. The only thing that couples them is the early stop, which looks at the largest relative
change over the whole weight. `torchao.hqq_in_blocks` runs every iteration on one block of rows
while it is in cache and keeps each iteration's scales and largest change; the stop is then the
first iteration whose largest change over every block is below the tolerance, as upstream's, and
the scales are that iteration's. Each element meets the same operations in the same order, so
the quantized weights and scales are upstream's, bit for bit (the tests compare them, early stop
included). Stochastic rounding (random numbers drawn in another order) goes to upstream.
"""

from __future__ import annotations

import torch
from torchao.quantization import quant_primitives
from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

from . import Patch

NAME = "_choose_qparams_and_quantize_scale_only_hqq"
_UPSTREAM = getattr(quant_primitives, NAME)
# fp32 weights per block: on Phi-4-mini's four linears, 28.2 s a layer for upstream's whole-weight
# passes; blocks of 256 KB 7.3 s (per-op overhead), 1 MB 3.2, 2 MB 2.6, 4 MB 3.4, 16 MB 10.5
BLOCK_BYTES = 2 << 20


def hqq_in_blocks(hp_tensor: torch.Tensor, block_size, qmin: int, qmax: int, *, iters: int = 20,
                  stochastic: bool = False, early_stop_tol: float = 1e-5):
    """Upstream's HQQ scale-only search (same arguments, same results), a block of rows at a
    time."""
    if stochastic or hp_tensor.ndim != 2 or len(block_size) != 2 or block_size[0] != 1 \
            or block_size[1] < 1 or hp_tensor.shape[1] % block_size[1] or qmin >= qmax:
        return _UPSTREAM(hp_tensor, block_size, qmin, qmax, iters=iters, stochastic=stochastic,
                         early_stop_tol=early_stop_tol)  # and its assertions
    n, k = hp_tensor.shape
    size = int(block_size[1])
    groups, steps = k // size, max(1, iters)
    eps = torch.finfo(torch.float32).eps
    qabs = max(abs(qmin), abs(qmax)) or 1
    rows = max(1, BLOCK_BYTES // (4 * k))
    starts = range(0, n, rows)
    scales = torch.empty(steps, n, groups)  # each iteration's, to take the stopping one's
    change = torch.empty(steps, len(starts))  # each iteration's largest, per block

    def block(start: int) -> torch.Tensor:
        w = hp_tensor[start:start + rows].to(torch.float32).contiguous()
        return w.view(-1, groups, size)

    for b, start in enumerate(starts):
        wg = block(start)
        scale = (wg.abs().amax(dim=2) / qabs).clamp_min(eps)
        prev = scale.clone()
        for step in range(steps):
            q = (wg / scale.unsqueeze(-1)).round().clamp(qmin, qmax)
            num = (wg * q).sum(dim=2, dtype=torch.float32)
            den = (q * q).sum(dim=2, dtype=torch.float32)
            scale = torch.where(den > 0, num / den, prev).clamp_min(eps).abs()
            change[step, b] = ((scale - prev).abs() / prev.clamp_min(eps)).max()
            scales[step, start:start + rows] = scale
            prev = scale
    below = (change.amax(dim=1) < early_stop_tol).nonzero()
    scale = scales[int(below[0]) if len(below) else steps - 1]
    qdata = torch.empty(n, k, dtype=torch.int32)
    for start in starts:
        q = (block(start) / scale[start:start + rows].unsqueeze(-1)).round().clamp(qmin, qmax)
        qdata[start:start + rows] = q.view(-1, k)
    return qdata, scale.to(hp_tensor.dtype, copy=True)  # not a view holding every step's


def _install() -> None:
    setattr(intx, NAME, hqq_in_blocks)


def _restore() -> None:
    setattr(intx, NAME, _UPSTREAM)


PATCHES = (
    Patch(name="torchao.hqq_in_blocks", summary="HQQ's scale search runs a cache-sized block of "
          "rows at a time: the same scales and weights", written_for={"torchao": "0.18."},
          pins={f"torchao.quantization.quant_primitives:{NAME}": "10aca3ea066078ff",
                "torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor:"
                "IntxUnpackedToInt8Tensor.from_hp": "32fcba67f787e098"},
          install=_install, restore=_restore,
          installed=lambda: getattr(intx, NAME) is hqq_in_blocks),
)
