"""XNNPACK, ExecuTorch's CPU backend: fp32 with dynamic sequence length.

Attention uses ExecuTorch's `llama::update_cache` and `llama::custom_sdpa` (they run outside the
delegate, in ExecuTorch's optimized kernels); RMSNorm's mean is written as a linear because XNNPACK
averages only 4-D tensors over dims 2-3, and a `mean.dim` breaks the graph at every norm.

Lowering shares the weights with ExecuTorch instead of letting it copy them twice (see
xnnpack_lean.py); EDGELLM_UPSTREAM_COPIES=1 lowers exactly as ExecuTorch does, to compare.
"""

from . import Backend, switch_workarounds


def _partitioners(options) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    partitioner = XnnpackPartitioner()
    if _lean_preprocess():
        _check_up_front(partitioner)
    return [partitioner]


def _check_up_front(partitioner) -> None:
    """Answer `ops_to_not_decompose` without a check function when every node it would check
    passes: ExecuTorch then keeps those ops whole with one decomposition of the program instead
    of three (its EDGE_DO_NOT_DECOMP path: decompose, mark the nodes the check accepts, decompose
    again, unmark), which is 9 of the 35 s XNNPACK fp32 lowering takes for LFM2.5-350M. When all
    pass, both paths keep the same nodes; when one fails, the check goes to ExecuTorch as before.
    The ops are filtered as ExecuTorch's EDGE_DO_NOT_DECOMP path filters them."""
    from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose

    upstream = partitioner.ops_to_not_decompose

    def ops_to_not_decompose(ep):
        ops, check = upstream(ep)
        if check is None:
            return ops, check
        kept = set(ops)
        if all(check(n) for n in ep.graph.nodes if n.op == "call_function" and n.target in kept):
            return _remove_invalid_ops_for_not_decompose(list(ops)), None
        return ops, check

    partitioner.ops_to_not_decompose = ops_to_not_decompose


def _lean_preprocess() -> bool:
    """Install (or, with EDGELLM_UPSTREAM_COPIES=1, remove) the workarounds in xnnpack_lean.py,
    which save two copies of the weights while lowering (4.6 GB -> 2.3 GB peak for LFM2.5-350M
    fp32) and give the same .pte. They patch ExecuTorch 1.5's internals, so any other version
    lowers as ExecuTorch does. Called each time partitioners are made; idempotent. Returns
    whether edgellm's workarounds apply (the partitioner's too)."""
    from executorch.version import __version__

    return switch_workarounds("xnnpack_lean", __version__.startswith("1.5."))


BACKEND = Backend(
    name="xnnpack",
    summary="CPU (arm64, x86-64) through XNNPACK; dynamic prompt length",
    dynamic_shapes=True,
    make_partitioners=_partitioners,
    writing={"attention": "custom_ops", "norm": "linear_mean", "separate_head": True},
    requires=("executorch.backends.xnnpack",),
)
