"""`to_executorch` of ExecuTorch 1.5: the emitter kept from copying every constant the .pte holds,
and a pass of torch's run once instead of once per submodule.

`emit.constants_by_reference`: `_Emitter._tensor_spec_to_evalue` copies each constant tensor's
storage into `bytes` (to hash it), and `_save_new_const_tensor` keeps those `bytes` as the
constant's `Buffer` until the .pte is written, beside the tensor itself, which the exported
program still holds: every constant left outside a delegate is in memory twice. Those are the
undelegated embedding table and, for a mixture-of-experts model, every expert's packed weights
(LFM2-8B-A1B: 4 to 6 GB). The patch keeps the constant as a `TensorBackedData` of the tensor's
storage instead, so the `bytes` are freed as soon as they are hashed; the serializer writes the
same bytes from the tensor's memory. Constants stored outside the .pte and mutable buffers'
initial states go upstream's way.

`emit.functionalization_removed_once`: `to_executorch` first puts the in-place ops back
(torch's `unsafe_remove_auto_functionalized_pass`), whose loop runs over the program's
submodules but works each time on the top graph: decompose, then dead-code elimination and a
recompile of the whole graph, once per submodule. A program with a delegate per expert behind a
cond per expert (`--experts chosen`: LFM2-8B-A1B, 704 conds, 1408 branches and as many
delegates) did it some 2800 times. The second run of it on a graph changes nothing, so once is
the same graph.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir.emit._emitter import _Emitter
from executorch.exir.program import _program
from executorch.exir.schema import TensorDataLocation

from . import Patch, replacing

_UPSTREAM_SAVE = _Emitter.__dict__["_save_new_const_tensor"]
_COMPARE_CHUNK = 1 << 24  # bytes compared at a time: no temporary the size of a whole weight
BY_REFERENCE_FROM = 1 << 20  # bytes: smaller constants stay `bytes`


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


def _save_by_reference(self, spec, buffer_data, hashed, allocation_info=None,
                       constant_tag=None):
    """Upstream's, given the constant's storage in place of the `bytes` copied from it where the
    constant goes into the .pte's constant segment."""
    info = spec.extra_tensor_info
    external = (info is not None and info.fully_qualified_name is not None
                and info.location == TensorDataLocation.EXTERNAL)
    if not external and not allocation_info and len(buffer_data) >= BY_REFERENCE_FROM:
        storage = spec.storage
        if storage.nbytes() == len(buffer_data):  # what upstream copied: the whole storage
            buffer_data = TensorBackedData(torch.empty(0, dtype=torch.uint8).set_(storage))
    return _UPSTREAM_SAVE(self, spec, buffer_data, hashed, allocation_info, constant_tag)


def _remove_auto_functionalized_once(ep):
    """unsafe_remove_auto_functionalized_pass's body, once (upstream: once per submodule)."""
    from torch._higher_order_ops.auto_functionalize import (auto_functionalized,
                                                            auto_functionalized_v2)
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torch.export._remove_auto_functionalized_pass import remove_self_clone

    with ep.graph_module._set_replace_hook(ep.graph_signature.get_replace_hook()):
        for node in ep.graph.nodes:
            if node.op == "call_function" and node.target in (auto_functionalized,
                                                              auto_functionalized_v2):
                if not isinstance(node.args[0], torch._ops.OpOverload):
                    raise AssertionError(f"Expected func to be an OpOverload, but got "
                                         f"{type(node.args[0])}")
                node.meta["only_clone_these_tensors"] = []  # re-inplace everything
        decompose_auto_functionalized(ep.graph)
        remove_self_clone(ep.graph)
        ep.graph.eliminate_dead_code()
    return ep


PATCHES = (
    Patch(name="emit.constants_by_reference", summary="the emitter keeps each constant the .pte "
          "holds as its tensor's storage instead of a copy in bytes",
          written_for={"executorch": "1.5."}, pins={
              "executorch.exir.emit._emitter:_Emitter._save_new_const_tensor": "6b9ac7c29901c3a9",
              "executorch.exir.emit._emitter:_Emitter._tensor_spec_to_evalue": "f3b5b9a22e5e8125",
              "executorch.exir._serialize._program:_extract_constant_segment": "520b3ccd12db5003",
              "executorch.exir._serialize._cord:FileBackedData": "274534a6fc9df21f"},
          **replacing(_Emitter, "_save_new_const_tensor", _save_by_reference)),
    Patch(name="emit.functionalization_removed_once", summary="to_executorch puts the in-place "
          "ops back in one pass over the program instead of one per submodule",
          written_for={"executorch": "1.5.", "torch": "2.13."}, pins={
              "torch.export._remove_auto_functionalized_pass:"
              "unsafe_remove_auto_functionalized_pass": "f4e3301f612ca059",
              "executorch.exir.program._program:EdgeProgramManager.to_executorch":
                  "6aeac465eada591f"},
          **replacing(_program, "unsafe_remove_auto_functionalized_pass",
                      _remove_auto_functionalized_once)),
)
