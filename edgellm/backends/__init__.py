"""Backends as data: what each needs from the model and the exporter, and its partitioners.

A backend is one file here that defines `BACKEND`. The pipeline reads the fields below and never
branches on a backend's name. A chain (`coreml,xnnpack`) hands the partitioners to
`to_edge_transform_and_lower` as one ordered list; the first backend chooses how the model is
written (it receives the graph first), and shapes are static if any backend needs them static.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import BackendUnavailable, InputError


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
    # (attention, norm, state_write, rope, conv, fold_norms); unset ones keep their defaults.
    writing: dict = field(default_factory=dict)
    options: type = NoOptions  # frozen dataclass of this backend's options
    requires: tuple[str, ...] = ()  # modules its SDK needs, checked before any heavy work
    runs_here: bool = True  # can this machine's ExecuTorch runtime execute its programs
    # (written .pte, options, {method: {buffer: facts}}) -> report entries per delegate; raises
    # VerificationError when a delegate disagrees with what the options asked for
    inspect_delegates: Callable | None = None
    # (ExportConfig, options) -> problems with the export as a whole, e.g. options that
    # contradict the config's other fields
    config_problems: Callable | None = None
    # (written .pte) -> None: rewrites the file in place, keeping its length, before it is read
    finish_program: Callable | None = None

    def check_available(self) -> None:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise BackendUnavailable(
                f"Backend '{self.name}' needs {', '.join(missing)}, which is not installed. "
                f"Install it (pip install {' '.join(missing)}) or choose another backend; "
                "`edgellm models` lists them.")


UPSTREAM_COPIES = "EDGELLM_UPSTREAM_COPIES"


def upstream_copies() -> bool:
    """True when EDGELLM_UPSTREAM_COPIES=1 asks to lower exactly as ExecuTorch and coremltools
    do, without the workarounds in xnnpack_lean.py, coreml_lean.py and exir_lean.py (to compare;
    the programs are the same)."""
    value = os.environ.get(UPSTREAM_COPIES, "0")
    if value not in ("0", "1"):
        raise InputError(f"{UPSTREAM_COPIES}={value!r} is not understood. Allowed: 0 (share the "
                         "weights while lowering, the default) or 1 (copy them as ExecuTorch "
                         "does). Unset it or set one of those.")
    return value == "1"


def switch_workarounds(name: str, applies: bool) -> bool:
    """Install the workarounds of the `*_lean` module `name` of this package when `applies` (the
    versions they were written for are the ones installed), or put upstream's methods back when
    EDGELLM_UPSTREAM_COPIES=1. Idempotent; returns whether they are installed."""
    upstream = upstream_copies()  # a bad value is refused whatever the versions
    if not applies:
        return False
    lean = importlib.import_module(f"{__name__}.{name}")
    if upstream:
        lean.restore()
    else:
        lean.install()
    return not upstream


def _registry() -> dict[str, Backend]:
    from . import coreml, portable, vulkan, xnnpack

    return {b.name: b for b in (xnnpack.BACKEND, coreml.BACKEND, vulkan.BACKEND, portable.BACKEND)}


BACKENDS = _registry()


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise InputError(f"Unknown backend '{name}'. Supported: {', '.join(BACKENDS)}. "
                         "Run `edgellm models` to see every architecture and backend.") from None


def check_chain(names) -> list[str]:
    """Problems with an ordered chain of backend names (empty when it makes sense)."""
    names = list(names)
    if not names:
        return ["backends: give at least one backend, e.g. xnnpack"]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        return [f"backends: unknown backend(s) {', '.join(map(repr, unknown))}; "
                f"supported: {', '.join(BACKENDS)}"]
    out = []
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        out.append(f"backends: {', '.join(dupes)} listed more than once in {','.join(names)}")
    if "xnnpack" in names[:-1]:
        after = names[names.index("xnnpack") + 1]
        out.append(f"backends: {after} after xnnpack in {','.join(names)} would only see what "
                   "XNNPACK leaves, ExecuTorch's llama:: custom ops it cannot run; XNNPACK is the "
                   f"CPU fallback and goes last (e.g. {after},xnnpack)")
    undelegated = [n for n in names if not BACKENDS[n].requires]
    if undelegated and len(names) > 1:
        out.append(f"backends: '{undelegated[0]}' means no delegate and cannot be chained with "
                   f"others ({','.join(names)}); use it alone")
    return out


@dataclass(frozen=True)
class Plan:
    """What a chain of backends asks of the model and the exporter."""

    backends: tuple[Backend, ...]
    options: tuple[Any, ...]

    @property
    def dynamic_shapes(self) -> bool:
        return all(b.dynamic_shapes for b in self.backends)

    def model_options(self, cfg, stored: dict | None = None):
        """How the model is written for this chain and export config: the first backend's
        `writing`, except that where the recipe keeps the source's 4-bit grids (`stored`: its
        storage types; quantize.keeps_source_grids) no norm weight is folded into the linears
        after it, which would move their blocks off the grid, and q and k stay two linears,
        under the names the storage types are known by."""
        from ..architectures.layers import ModelOptions
        from ..quantize import keeps_source_grids

        writing = dict(self.backends[0].writing)
        if keeps_source_grids(cfg, stored):
            writing["fold_norms"] = writing["fuse_qk"] = False
        return ModelOptions(max_context_len=cfg.context_len, **writing)

    def partitioners(self) -> list:
        return [p for b, o in zip(self.backends, self.options) for p in b.make_partitioners(o)]


def plan_for(config) -> Plan:
    backends = tuple(get_backend(n) for n in config.backends)
    for b in backends:
        b.check_available()
    return Plan(backends, tuple(config.options_for(b.name) for b in backends))
