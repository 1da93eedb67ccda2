"""XNNPACK, ExecuTorch's CPU backend: fp32 with dynamic sequence length.

Attention uses ExecuTorch's `llama::update_cache` and `llama::custom_sdpa` (they run outside the
delegate, in ExecuTorch's optimized kernels); RMSNorm's mean is written as a linear because XNNPACK
averages only 4-D tensors over dims 2-3, and a `mean.dim` breaks the graph at every norm.
"""

from . import Backend


def _partitioners(options) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


BACKEND = Backend(
    name="xnnpack",
    summary="CPU (arm64, x86-64) through XNNPACK; dynamic prompt length",
    dynamic_shapes=True,
    make_partitioners=_partitioners,
    writing={"attention": "custom_ops", "norm": "linear_mean", "separate_head": True},
    requires=("executorch.backends.xnnpack",),
)
