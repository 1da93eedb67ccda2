"""Vulkan, ExecuTorch's GPU backend for Android. Shapes are static (one token per call).

Programs can be built on Linux but not run here: the Linux ExecuTorch wheel has no Vulkan runtime.
Lowering runs with edgellm's Vulkan patch (edgellm/patches/vulkan.py: pattern graphs built once).
"""

from .base import Backend


def _partitioners(options) -> list:
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    return [VulkanPartitioner()]


BACKEND = Backend(
    name="vulkan",
    external_weights=("ExecuTorch 1.5.1's Vulkan delegate keeps its weights in its own payload "
                      "(it reads no delegate_constant_tag)"),
    summary="Android GPUs through Vulkan; static shapes; builds here, runs on device",
    dynamic_shapes=False,
    runs_here=False,  # the Linux runtime has no such backend; programs run on device
    make_partitioners=_partitioners,
    # The Vulkan partitioner takes over any buffer whose users all sit in its delegate; a conv
    # state written by copy_ then loses its buffer (SpecViolationError). index_put_ stays outside.
    writing={"attention": "sdpa", "norm": "mean", "state_write": "index_put"},
    requires=("executorch.backends.vulkan.partitioner",),
    kv_caches={"int8": "ExecuTorch's Vulkan delegate registers llama::custom_sdpa over float "
                       "caches but no llama::custom_quantized_sdpa; the int8 attention would run "
                       "on the CPU, outside the GPU"},
    patches=("vulkan",),
    from_executorch=lambda fields: ({}, {}, []),  # export_llm's backend.vulkan has no options
)
