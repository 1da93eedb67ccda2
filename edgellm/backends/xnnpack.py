"""XNNPACK, ExecuTorch's CPU backend: fp32 with dynamic sequence length.

Attention uses ExecuTorch's `llama::update_cache` and `llama::custom_sdpa` (they run outside the
delegate, in ExecuTorch's optimized kernels); RMSNorm's mean is written as a linear because XNNPACK
averages only 4-D tensors over dims 2-3, and a `mean.dim` breaks the graph at every norm.

Lowering runs with edgellm's XNNPACK patches (edgellm/patches/xnnpack.py: shared weights, no
retrace of unchanged graphs, one decomposition); EDGELLM_NO_PATCHES=all lowers exactly as
ExecuTorch does, to compare.
"""

from .base import Backend

# weight-only linears reaching XNNPACK anywhere in a chain come out wrong, hence refused
WRONG_WEIGHT_ONLY = ("ExecuTorch 1.5.1's XNNPACK delegate takes torchao weight-only linears but "
                     "multiplies by the unscaled integers (wrong logits, no error)")


def _partitioners(options) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


def _from_executorch(fields: dict) -> tuple[dict, dict, list[str]]:
    """export_llm's backend.xnnpack fields: `extended_ops` is what edgellm always does."""
    problems = []
    if "extended_ops" in fields and fields.pop("extended_ops") is not True:
        problems.append("backend.xnnpack.extended_ops: false is not supported; edgellm hands "
                        "XNNPACK every op it supports (extended_ops: true)")
    return {}, {}, problems


BACKEND = Backend(
    name="xnnpack",
    summary="CPU (arm64, x86-64) through XNNPACK; dynamic prompt length",
    dynamic_shapes=True,
    make_partitioners=_partitioners,
    writing={"attention": "custom_ops", "norm": "linear_mean", "separate_head": True,
             "delta_rule": "op"},
    requires=("executorch.backends.xnnpack",),
    recipes=("8da4w", "8da8w"),
    refuses={"4w": f"{WRONG_WEIGHT_ONLY}; use 8da4w on xnnpack",
             "8w": f"{WRONG_WEIGHT_ONLY}; use 8da8w on xnnpack"},
    quantized_embeddings=True,
    # ExecuTorch's quantized cache: llama::update_cache and llama::custom_quantized_sdpa, CPU
    # kernels beside the delegate like custom_sdpa
    kv_caches={"int8": {}},
    goes_last="XNNPACK leaves, ExecuTorch's llama:: custom ops it cannot run; XNNPACK is the "
              "CPU fallback",
    patches=("xnnpack",),
    from_executorch=_from_executorch,
)
