"""XNNPACK lowering without two extra copies of the weights: workarounds for ExecuTorch 1.5.1.

ExecuTorch 1.5.1 holds every weight three times while it lowers to XNNPACK (LFM2.5-350M fp32, whose
weights are 1.35 GB, peaks at 4.6 GB; 2.3 GB with these workarounds):
- `BackendDetails.copy_exported_program_for_preprocess` deep-copies each partition's program,
  weights included, and `lower_all_submodules_to_backend` makes every partition's copy before the
  first `preprocess`, although `XnnpackBackend.preprocess` only reads the weights.
- `NodeVisitor.get_serialized_buffer_index` stores each constant in the NamedDataStore as `bytes`,
  which live until the .pte is written, although most are the weight's own bytes.

And it spends half its lowering time retracing graphs nothing changed:
- `XNNPACKPassManager` runs 17 passes over every partition; each ends in `ExportPass.call`, which
  retraces the whole graph with fake tensors (for 8da4w, running torchao's quantize ops' Python
  bodies again), whether or not the pass found anything to rewrite. An LLM's partitions have no
  batch norm, upsample, PReLU or max pool, so most of those retraces reproduce the graph.

`install()` shares compact weights with the copy (through the hook ExecuTorch gives backends),
wraps `preprocess` so that a buffer equal to a weight's storage is written from that storage, and
runs XNNPACK's passes skipping the retrace of a graph its pass left unchanged (`_RetraceGuard`);
`restore()` puts ExecuTorch's own methods back. No ExecuTorch source is rewritten, and the .pte is
byte-identical either way. Imported only by `switch_workarounds` for `xnnpack._lean_preprocess`,
after its version check.

What remains of the peak: one partition's `bytes` while its preprocess runs (the 256 MB head is
the largest), the emitter's `bytes` of the undelegated embedding table (exir/emit/_emitter.py,
also 256 MB), and the copies of weights that are views (below).
"""

from __future__ import annotations

import copy
import functools
import hashlib

import numpy as np
import torch
from executorch.backends.xnnpack._passes import XNNPACKPass, XNNPACKPassManager
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir.pass_base import ExportPass
from executorch.exir.program._program import _transform
from torch.fx.passes.infra.pass_base import PassResult

_UPSTREAM_PREPROCESS = XnnpackBackend.__dict__["preprocess"]  # a staticmethod
_UPSTREAM_TRANSFORM = XNNPACKPassManager.__dict__["transform"]
_COPY_HOOK = "copy_exported_program_for_preprocess"
_COMPARE_CHUNK = 1 << 24  # bytes compared at a time: no temporary the size of a whole weight


class TensorBackedData(FileBackedData):
    """A tensor's whole storage as named data, read from the tensor's memory when written.

    A FileBackedData because NamedDataStore, Cord and the .pte serializer accept only `bytes` and
    FileBackedData (ExecuTorch's CUDA backend stores files that way); none of them opens `_path`.
    """

    def __init__(self, tensor: torch.Tensor):
        # (nbytes,) uint8 over the same memory; it keeps the storage alive
        self._array = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy()
        self._path, self._size = None, self._array.nbytes
        self._sha256, self._finalizer = None, None

    def equals(self, data: bytes) -> bool:
        other = np.frombuffer(data, dtype=np.uint8)
        return len(other) == self._size and all(
            np.array_equal(self._array[i:i + _COMPARE_CHUNK], other[i:i + _COMPARE_CHUNK])
            for i in range(0, self._size, _COMPARE_CHUNK))

    def prefix(self, size: int) -> bytes:
        return self._array[:size].tobytes()

    def sha256(self) -> bytes:
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self._array).digest()
        return self._sha256

    def to_bytes(self) -> bytes:
        return self._array.tobytes()

    def write_to_file(self, outfile) -> None:
        outfile.write(memoryview(self._array))

    def close(self) -> None:  # no file to remove
        pass

    def __deepcopy__(self, memo):  # read-only data: copies of a program may share it
        return self


def compact_weights(ep) -> list[torch.Tensor]:
    """The program's weights that own their whole storage. XNNPACK serializes a constant's whole
    untyped storage, so a view (edgellm's LFM2 in_proj chunks share one storage three times their
    size) must keep being deep-copied, which clones a Parameter into a storage of its own (a plain
    tensor view keeps its whole storage through deepcopy, in ExecuTorch's hook as here)."""
    tensors = [*ep.state_dict.values(), *ep.constants.values()]
    return [t for t in tensors if type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.device.type == "cpu" and t.layout == torch.strided
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes]


def _copy_sharing_weights(cls, edge_program, compile_specs):
    """The graph copied, as ExecuTorch's hook does, but compact weights shared: a deepcopy whose
    memo already maps each one to itself."""
    memo = {id(t): t for t in compact_weights(edge_program)}
    return copy.deepcopy(edge_program, memo)


def _preprocess_from_weights(edge_program, compile_specs):
    """ExecuTorch's XnnpackBackend.preprocess, then each named-data buffer equal to a weight's
    storage is swapped for a TensorBackedData of it, so this partition's `bytes` are freed now
    instead of living until the .pte is written. Converted layouts and packed 4-bit weights match
    no weight and stay bytes."""
    weights = compact_weights(edge_program)  # before passes swap state_dict entries
    result = _UPSTREAM_PREPROCESS.__func__(edge_program, compile_specs)
    if result.data_store_output is not None:
        after = {id(t): t for t in [*weights, *compact_weights(edge_program)]}  # each once
        back_with_weights(result.data_store_output.buffers, list(after.values()))
    return result


def back_with_weights(buffers: list, weights: list[torch.Tensor]) -> int:
    """Replace, in place, each bytes buffer whose content equals a weight's storage; returns how
    many were replaced. Candidates are found by size and first bytes, then compared in full."""
    candidates: dict[tuple, list[TensorBackedData]] = {}
    for t in weights:
        data = TensorBackedData(t)
        candidates.setdefault((len(data), data.prefix(64)), []).append(data)
    replaced = 0
    for i, buf in enumerate(buffers):
        if not isinstance(buf, bytes):
            continue
        match = next((d for d in candidates.get((len(buf), buf[:64]), ()) if d.equals(buf)), None)
        if match is not None:
            buffers[i], replaced = match, replaced + 1
    return replaced


# ExportPass's per-node hooks: a pass overriding any of them rewrites the graph while it retraces
_NODE_HOOKS = tuple(h for h in dir(ExportPass) if h.startswith("call_") or h in ("placeholder",
                                                                                 "output"))


def structure(graph) -> tuple:
    """What a retrace could rebuild differently: every node's kind, name, target and arguments."""
    def arg(a):
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        return ("%", a.name) if isinstance(a, torch.fx.Node) else repr(a)
    return tuple((n.op, n.name, str(n.target), arg(n.args), arg(n.kwargs)) for n in graph.nodes)


class _RetraceGuard(ExportPass):
    """Placed between a pass and ExportPass in the method order, so the pass's closing
    `super().call(graph_module)` (ExportPass's retrace, "to regenerate metadata") lands here first.
    When the graph is what it was before the pass ran, the pass rewrote nothing: a retrace would
    rebuild the same nodes (their metadata, the pass's tags included, is carried over either way),
    so the graph is handed back as it is."""

    unchanged_if: tuple | None = None  # the graph's structure before the pass

    def call(self, graph_module):
        if self.unchanged_if is not None and structure(graph_module.graph) == self.unchanged_if:
            return PassResult(graph_module, False)
        return super().call(graph_module)


@functools.cache
def _guarded(pass_type: type) -> type:
    return type(pass_type.__name__, (pass_type, _RetraceGuard), {})


def _transform_skipping_retraces(self):
    """XNNPACKPassManager.transform, with each pass that rewrites only in its own `call` (no
    per-node hook) guarded by _RetraceGuard. The graph preprocess received is never left
    unretraced: ExecuTorch keeps it as the delegate's original program, and upstream's passes
    mutate it only until the first retrace."""
    if not all(issubclass(p, ExportPass) for p in self.passes):
        return _UPSTREAM_TRANSFORM(self)  # which raises its own error
    ep = self.exported_program
    received = ep.graph_module
    for pass_ in self.passes:
        guard = all(getattr(pass_, h) is getattr(ExportPass, h) for h in _NODE_HOOKS)
        cls = _guarded(pass_) if guard else pass_
        transform_pass = cls(ep) if issubclass(pass_, XNNPACKPass) else cls()
        if guard and ep.graph_module is not received:
            transform_pass.unchanged_if = structure(ep.graph_module.graph)
        ep = _transform(ep, transform_pass)
    return ep


def install() -> None:
    """Idempotent: the wrapper calls ExecuTorch's preprocess, never the attribute it replaced."""
    setattr(XnnpackBackend, _COPY_HOOK, classmethod(_copy_sharing_weights))
    XnnpackBackend.preprocess = staticmethod(_preprocess_from_weights)
    XNNPACKPassManager.transform = _transform_skipping_retraces


def restore() -> None:
    """ExecuTorch's own copy hook (BackendDetails'), preprocess and pass manager."""
    if _COPY_HOOK in XnnpackBackend.__dict__:
        delattr(XnnpackBackend, _COPY_HOOK)
    XnnpackBackend.preprocess = _UPSTREAM_PREPROCESS
    XNNPACKPassManager.transform = _UPSTREAM_TRANSFORM


def installed() -> bool:
    return XnnpackBackend.preprocess is _preprocess_from_weights
