"""The private upstream names edgellm calls outside its patches, where no public API does the
same, each pinned as a patch is: the versions it was written for and a digest of the source of
what it calls or relies on (tests/test_patches.py compares them, and lists every private
upstream name edgellm's code spells: one not declared here fails it). Nothing replaces them, so
there is nothing to switch off: where one changed upstream, the export still calls it, says so
on stderr, and report.json's `private_upstream` names it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from . import MODULES, installed_version, resolve, source_digest


@dataclass(frozen=True)
class Pin:
    uses: tuple  # the private names edgellm's code spells
    why: str  # who calls it, and why no public API serves
    written_for: dict  # {distribution: version prefix}
    pins: dict  # {"package.module:Qualified.name": digest of its source}

    def changed(self) -> list[str]:
        """What is not as pinned here: versions, then sources (or what no longer resolves)."""
        out = [f"{dist} {installed_version(dist)} (written for {prefix}x)"
               for dist, prefix in self.written_for.items()
               if not installed_version(dist).startswith(prefix)]
        for path, digest in self.pins.items():
            try:
                found = upstream_digest(path)
            except (ImportError, AttributeError, OSError, TypeError) as e:
                out.append(f"{path} is gone ({type(e).__name__})")
                continue
            if found != digest:
                out.append(f"{path} changed upstream")
        return out


def upstream_digest(path: str) -> str:
    """The digest of upstream's `path`: where one of edgellm's patches has it replaced (an
    export is under way), the one that patch read before installing itself."""
    for module in MODULES:
        for patch in getattr(sys.modules.get(f"{__package__}.{module}"), "PATCHES", ()):
            if path in patch.found and patch.installed():
                return patch.found[path]
    return source_digest(resolve(path))


EXECUTORCH, TORCH, GGUF = {"executorch": "1.5."}, {"torch": "2.13."}, {"gguf": "0.19."}
PINS = (
    Pin(("_program", "_gen_edge_manager_for_partitioners"),
        "lower._export_edge: an expert's edge program decomposed as its partitioners ask, the "
        "first step of to_edge_transform_and_lower, which has no public form", EXECUTORCH,
        {"executorch.exir.program._program:_gen_edge_manager_for_partitioners":
         "14a2b38bd338a215"}),
    Pin(("_original_exported_program",),
        "lower.lower_experts: each expert delegate's original program replaced by one small "
        "stand-in (the originals hold every expert's weights)", EXECUTORCH,
        {"executorch.exir.lowered_backend_module:LoweredBackendModule.__init__":
         "96d1be41da99fcbd"}),
    Pin(("to_backend",),
        "lower._expert_delegate: an expert lowered by each partitioner in turn (public, but "
        "deprecated in favour of to_edge_transform_and_lower)", EXECUTORCH,
        {"executorch.exir.program._program:EdgeProgramManager.to_backend": "6aeac465eada591f"}),
    Pin(("_functorch", "_aot_autograd", "UnwrapTensorSubclass", "_python_dispatch"),
        "lower._flat_weights: a quantized weight's plain tensors named as torch.export names "
        "them", TORCH,
        {"torch._functorch._aot_autograd.subclass_parametrization:UnwrapTensorSubclass":
         "ea1ab7dbee177fe5",
         "torch.utils._python_dispatch:is_traceable_wrapper_subclass": "1d97b30149f25e5a"}),
    Pin(("_pytree",), "lower: the leaves of a method's example inputs", TORCH,
        {"torch.utils._pytree:tree_leaves": "5fdc4a1e690fe7c2"}),
    Pin(("_ops",), "report.op_name: an edge-dialect op's ATen op", TORCH,
        {"torch._ops:OpOverload": "88ef9414716664b4"}),
    Pin(("_check",), "architectures.layers: a bound torch.export must know (its documented "
        "way)", TORCH, {"torch:_check": "a6343f21c57e95c4"}),
    Pin(("_serialize", "_flatbuffer_to_program", "_get_extended_header"),
        "backends.coreml_payload: the program's header and flatbuffer read without its "
        "segments (deserializing the whole program holds every segment twice)", EXECUTORCH,
        {"executorch.exir._serialize._program:_flatbuffer_to_program": "6049cdaabf3460f7",
         "executorch.exir._serialize._program:_get_extended_header": "fc22c1e2fcab868d"}),
    Pin(("_build_tensors",),
        "sources.gguf: the file's sizes checked before gguf's reader builds its tensors, so "
        "that a cut file is said to be cut", GGUF,
        {"gguf.gguf_reader:GGUFReader._build_tensors": "7b053ddf8e9166d4"}),
)


def status() -> dict[str, str]:
    """{each pin's first pinned name: "pinned" or what changed}: report.json's
    `private_upstream`."""
    out = {}
    for pin in PINS:
        changed = pin.changed()
        out[next(iter(pin.pins))] = "pinned" if not changed else "; ".join(changed)
    return out
