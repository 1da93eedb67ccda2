"""Backends as data: what each needs from the model and the exporter, and its partitioners.

Each backend is a file here that defines `BACKEND`, a `Backend` (base.py; coreml_payload.py
is Core ML's payload reader, not a backend). The pipeline reads its fields and never branches on
a backend's name. A chain (`coreml,xnnpack`) hands the partitioners to
`to_edge_transform_and_lower` as one ordered list; the first backend chooses how the model is
written (it receives the graph first), and shapes are static if any backend needs them static.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .base import Backend, NoOptions

__all__ = ["BACKENDS", "NOT_HERE", "Backend", "NoOptions", "Plan", "check_chain", "get_backend",
           "kv_cache_problems", "plan_for", "sink_problems"]


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
    chain = ",".join(names)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        out.append(f"backends: {', '.join(dupes)} listed more than once in {chain}")
    for name, after in zip(names, names[1:]):
        if BACKENDS[name].goes_last:
            out.append(f"backends: {after} after {name} in {chain} would only see what "
                       f"{BACKENDS[name].goes_last}, and goes last (e.g. {after},{name})")
            break
    undelegated = [n for n in names if not BACKENDS[n].delegates]
    if undelegated and len(names) > 1:
        out.append(f"backends: '{undelegated[0]}' means no delegate and cannot be chained with "
                   f"others ({','.join(names)}); use it alone")
    return out


def sink_problems(cfg, chain: list[Backend]) -> list[str]:
    """Attention sinks a chain cannot take: a prefill method of a static-shape program rewrites
    a ring whole (KVCache._rewrite), which knows no sink slots."""
    static = [b.name for b in chain if not b.dynamic_shapes]
    if cfg.attention_sink and cfg.prefill_chunk and static:
        return [f"attention_sink with prefill_chunk on {static[0]}: its prefill method writes a "
                "ring of fixed-length calls, which has no sink slots yet; drop prefill_chunk (a "
                "prompt then goes a token per call) or export for xnnpack"]
    return []


def external_problems(cfg, chain: list[Backend]) -> list[str]:
    """--external-weights on a backend whose delegates keep their weights in their payloads."""
    return [f"external_weights on {b.name}: {b.external_weights}; drop --external-weights, or "
            "export for xnnpack or portable" for b in chain
            if cfg.external_weights and b.external_weights]


def kv_cache_problems(dtype: str | None, chain: list[Backend], every: list[Backend]) -> list[str]:
    """A KV cache dtype the chain's first backend (which writes the model) has no kernels for."""
    first = chain[0] if chain else None
    if dtype is None or first is None or isinstance(first.kv_caches.get(dtype), dict):
        return []
    why = first.kv_caches.get(dtype) or f"{first.name} has no kernels for it"
    able = ", ".join(b.name for b in every if isinstance(b.kv_caches.get(dtype), dict))
    return [f"kv_cache: {dtype} on {first.name}: {why}. Backends with an {dtype} KV cache: "
            f"{able}; or leave kv_cache unset for caches in the model's dtype"]


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
        `writing`, except that where the recipe keeps the source's 4-bit grids or puts float
        weights on Q4_1's (`stored`: its storage types; quantize.plan.writes_linears_apart) no
        norm weight is folded into the linears after it, which would move their blocks off the
        grid or stretch them, and q and k stay two linears, under the names the storage types
        are known by."""
        from ..architectures.layers import ModelOptions
        from ..quantize.plan import writes_linears_apart

        writing = dict(self.backends[0].writing)
        if cfg.kv_cache:
            writing.update(self.backends[0].kv_caches[cfg.kv_cache], kv_cache=cfg.kv_cache)
        if writes_linears_apart(cfg, stored):
            writing["fold_norms"] = writing["fuse_qk"] = False
        sink = tuple(cfg.attention_sink) if cfg.attention_sink else None
        return ModelOptions(max_context_len=cfg.context_len, attention_sink=sink,
                            max_call_len=max(cfg.max_seq_len, cfg.prefill_chunk), **writing)

    def settled(self, cfg, state_bytes: int, weight_bytes: int) -> tuple["Plan", dict]:
        """The plan with every backend's options settled on the built model (Backend.settle),
        and what each backend reports about it, by backend name."""
        options, entries = [], {}
        for b, o in zip(self.backends, self.options):
            if b.settle is not None:
                o, entries[b.name] = b.settle(cfg, o, state_bytes, weight_bytes)
            options.append(o)
        return Plan(self.backends, tuple(options)), entries

    @property
    def patches(self) -> tuple[str, ...]:
        """The edgellm.patches the chain's lowering runs with."""
        return tuple(p for b in self.backends for p in b.patches)

    def partitioners(self) -> list:
        """Every backend's partitioners, in chain order."""
        return [p for b, o in zip(self.backends, self.options) for p in b.make_partitioners(o)]


def _mlx() -> str:
    import importlib

    try:
        importlib.import_module("executorch.backends.mlx")
        return "edgellm has no MLX backend yet"
    except ImportError as e:
        return (f"its lowering is not available in the Linux ExecuTorch wheel (importing "
                f"executorch.backends.mlx fails: {e})")


# ExecuTorch backends edgellm does not lower to, with a reason better than "unknown"
NOT_HERE = {"mlx": lambda: (f"MLX cannot be used: {_mlx()}. Export for Core ML "
                            "(backend.coreml.enabled: true) to run on Apple hardware")}


def plan_for(config) -> Plan:
    backends = tuple(get_backend(n) for n in config.backends)
    for b in backends:
        b.check_available()
    return Plan(backends, tuple(config.options_for(b.name) for b in backends))
