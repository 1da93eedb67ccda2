"""No delegate: ExecuTorch's portable kernels run every op. The baseline and the debugging aid."""

from .base import Backend

BACKEND = Backend(
    name="portable",
    summary="no delegate: ExecuTorch portable kernels (slow; for checking)",
    dynamic_shapes=True,
    make_partitioners=lambda options: [],
    writing={"attention": "sdpa", "norm": "mean", "delta_rule": "op"},
    quantized_embeddings=True,  # ExecuTorch's quantized_decomposed embedding kernels
    # the int8 cache exists only as ExecuTorch's llama:: ops (portable kernels themselves)
    kv_caches={"int8": {"attention": "custom_ops"}},
    delegates=False,
)
