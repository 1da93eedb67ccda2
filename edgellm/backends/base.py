"""What a backend declares (`Backend`): data the rest of edgellm reads instead of comparing a
backend's name."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import BackendUnavailable


@dataclass(frozen=True)
class NoOptions:
    """A backend without options of its own."""

    def problems(self) -> list[str]:
        return []


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    dynamic_shapes: bool  # can forward take T in 1..max_seq_len, or only T=1
    make_partitioners: Callable[[Any], list]  # options -> partitioners
    # How the model is written for this backend: fields of architectures.layers.ModelOptions
    # (attention, norm, state_write, rope, conv, fold_norms, fuse_qk, separate_head); unset
    # ones keep their defaults.
    writing: dict = field(default_factory=dict)
    options: type = NoOptions  # frozen dataclass of this backend's options
    requires: tuple[str, ...] = ()  # modules its SDK needs, checked before any heavy work
    runs_here: bool = True  # can this machine's ExecuTorch runtime execute its programs
    build_bytes_per_parameter: int = 0  # what building its program holds beyond the float model
    # Quantization: the linear recipes (quantize.RECIPES) it has kernels for as the first
    # backend of a chain; recipes refused wherever it stands in a chain, with the reason; whether
    # it stores embedding tables quantized.
    recipes: tuple[str, ...] = ()
    refuses: dict = field(default_factory=dict)
    quantized_embeddings: bool = False
    # KV cache dtypes besides the model's (config.KV_CACHES) as the first backend of a chain:
    # dtype -> `writing` fields that change with it (it has kernels), or the reason it has none
    kv_caches: dict = field(default_factory=dict)
    # Why it cannot take a mixture-of-experts model's quantized experts (ExecuTorch's
    # llama::quantized_moe_ffn, a CPU kernel beside the delegates) as the first backend, or None
    quantized_experts: str | None = None
    # Why its delegates cannot put their weights in the data file of --external-weights, or None
    external_weights: str | None = None
    # Chains: False for a backend that delegates nothing (it cannot be chained); why it must
    # come last when it must ("what <the backends after it> would see").
    delegates: bool = True
    goes_last: str | None = None
    patches: tuple[str, ...] = ()  # edgellm.patches its lowering runs with (the lower stage)
    # (export_llm's `backend.<name>` fields, without `enabled`) -> (options, {field: (recipe,
    # group_size)}, problems); fields it leaves in the mapping are refused by etconfig
    from_executorch: Callable | None = None
    # (written .pte, options, {method: {buffer: facts}}) -> report entries per delegate; raises
    # VerificationError when a delegate disagrees with what the options asked for
    inspect_delegates: Callable | None = None
    # (ExportConfig, options) -> problems with the export as a whole, e.g. options that
    # contradict the config's other fields
    config_problems: Callable | None = None
    # (ExportConfig, options, state bytes, weight bytes) -> (options, report entry): options
    # that depend on the built model (Core ML's `state: auto`), settled before lowering
    settle: Callable | None = None
    # (written .pte) -> None: rewrites the file in place, keeping its length, before it is read
    finish_program: Callable | None = None

    @property
    def custom_sdpa(self) -> bool:
        """Whether its attention is ExecuTorch's llama::custom_sdpa (export_llm's
        use_sdpa_with_kv_cache)."""
        return self.writing.get("attention") == "custom_ops"

    def check_available(self) -> None:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise BackendUnavailable(
                f"Backend '{self.name}' needs {', '.join(missing)}, which is not installed. "
                f"Install it (pip install {' '.join(missing)}) or choose another backend; "
                "`edgellm models` lists them.")
