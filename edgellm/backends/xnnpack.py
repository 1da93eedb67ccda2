"""XNNPACK, ExecuTorch's CPU backend: fp32 with dynamic sequence length.

Attention uses ExecuTorch's `llama::update_cache` and `llama::custom_sdpa` (they run outside the
delegate, in ExecuTorch's optimized kernels); RMSNorm's mean is written as a linear because XNNPACK
averages only 4-D tensors over dims 2-3, and a `mean.dim` breaks the graph at every norm.

Lowering shares the weights with ExecuTorch instead of letting it copy them twice (see
xnnpack_lean.py); EDGELLM_UPSTREAM_COPIES=1 lowers exactly as ExecuTorch does, to compare.
"""

import os

from ..errors import InputError
from . import Backend

UPSTREAM_COPIES = "EDGELLM_UPSTREAM_COPIES"


def _partitioners(options) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    _lean_preprocess()
    return [XnnpackPartitioner()]


def _lean_preprocess() -> None:
    """Install (or, with EDGELLM_UPSTREAM_COPIES=1, remove) the workarounds in xnnpack_lean.py,
    which save two copies of the weights while lowering (4.6 GB -> 2.3 GB peak for LFM2.5-350M
    fp32) and give the same .pte. They patch ExecuTorch 1.5's internals, so any other version
    lowers as ExecuTorch does. Called each time partitioners are made; idempotent."""
    from executorch.version import __version__

    value = os.environ.get(UPSTREAM_COPIES, "0")
    if value not in ("0", "1"):
        raise InputError(f"{UPSTREAM_COPIES}={value!r} is not understood. Allowed: 0 (share the "
                         "weights while lowering, the default) or 1 (copy them as ExecuTorch "
                         "does). Unset it or set one of those.")
    if not __version__.startswith("1.5."):
        return
    from . import xnnpack_lean

    if value == "1":
        xnnpack_lean.restore()
    else:
        xnnpack_lean.install()


BACKEND = Backend(
    name="xnnpack",
    summary="CPU (arm64, x86-64) through XNNPACK; dynamic prompt length",
    dynamic_shapes=True,
    make_partitioners=_partitioners,
    writing={"attention": "custom_ops", "norm": "linear_mean", "separate_head": True},
    requires=("executorch.backends.xnnpack",),
)
