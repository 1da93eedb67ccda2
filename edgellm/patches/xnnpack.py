"""XNNPACK lowering in ExecuTorch 1.5: patches that keep it from copying the weights twice,
retracing graphs nothing changed, and decomposing the program three times.

- `xnnpack.shared_weights`: `BackendDetails.copy_exported_program_for_preprocess` deep-copies
  each partition's program, weights included, and `lower_all_submodules_to_backend` makes every
  partition's copy before the first `preprocess`, although `XnnpackBackend.preprocess` only reads
  the weights; and `NodeVisitor.get_serialized_buffer_index` stores each constant in the
  NamedDataStore as `bytes`, which live until the .pte is written, although most are the weight's
  own bytes. The patch shares compact weights with the copy (through the hook ExecuTorch gives
  backends) and, after each `preprocess`, swaps every `bytes` buffer equal to a weight's storage
  for a `TensorBackedData` that writes from the tensor's memory.
- `xnnpack.skip_retraces`: `XNNPACKPassManager` runs its passes over every partition, and each
  ends in `ExportPass.call`, which retraces the whole graph with fake tensors whether or not the
  pass rewrote anything (an LLM's partitions have no batch norm, upsample, PReLU or max pool).
  The patch runs them with `_RetraceGuard` between each such pass and ExportPass: an unchanged
  graph is handed back as it is.
- `xnnpack.checks_at_ends`: each of those passes runs through its own ExecuTorch pass manager,
  which checks the program (recompile, lint, verifier) before and after it: two checks per pass
  and partition, each inner pair on the same graph. Inside `skip_retraces`' transform, the
  program is checked before the first pass and after the last.
- `xnnpack.unmatchable_sdpa`: the same for `ConvertToSDPAPass`: its two SDPA patterns (built once
  a process, ~2 s) each hold a `_softmax`; a partition without one skips building and matching,
  and the two `print_readable`s of the graph its debug log statements make.
- `xnnpack.signature_read_once`: the partitioner's configs ask, per node and argument, whether
  it is a parameter, buffer or constant, and each question builds a new dict of every input of
  the program; while it partitions, the program's signature builds each mapping once.
- `xnnpack.unmatchable_patterns`: `ConvertToUpsampleBilinear2d` builds four upsample patterns
  (four exports and edge lowerings, ~4 s once a process) and matches them in every partition;
  each holds an `upsample_bilinear2d` node, so a partition without one (an LLM's) skips both.
- `xnnpack.one_decomposition`: the partitioner answers `ops_to_not_decompose` with a check
  function, which sends ExecuTorch down its EDGE_DO_NOT_DECOMP path (decompose, mark the nodes
  the check accepts, decompose again, unmark). When every node the check would see passes, the
  patched partitioner answers without one, filtered as that path filters the ops: ExecuTorch then
  keeps the same nodes with one decomposition.

What remains of the peak: one partition's `bytes` while its preprocess runs (the head is the
largest) and copies of weights that are views (below); constants outside the delegates are
emit.py's. The .pte is byte-identical with and without them.
"""

from __future__ import annotations

import copy
import functools

import torch
from executorch.backends.xnnpack._passes import XNNPACKPass, XNNPACKPassManager
from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import (
    ConvertToUpsampleBilinear2d)
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
from executorch.exir.backend.canonical_partitioners.config_partitioner import (
    ConfigerationBasedPartitioner)
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import ExportPass
from executorch.exir.pass_manager import ExportedProgramPassManager
from executorch.exir.program._program import (
    _remove_invalid_ops_for_not_decompose, _transform, _transform_with_pass_manager)
from torch.export.graph_signature import ExportGraphSignature
from torch.fx.passes.infra.pass_base import PassResult

from . import Patch, replacing
from .emit import TensorBackedData

_UPSTREAM_PREPROCESS = XnnpackBackend.__dict__["preprocess"]  # a staticmethod
_UPSTREAM_TRANSFORM = XNNPACKPassManager.__dict__["transform"]
_SOFTMAX = exir_ops.edge.aten._softmax.default
_UPSTREAM_GENERATE = ConfigerationBasedPartitioner.__dict__["generate_partitions"]
_UPSAMPLE = exir_ops.edge.aten.upsample_bilinear2d.vec
_COPY_HOOK = "copy_exported_program_for_preprocess"


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
    for i, pass_ in enumerate(self.passes):
        guard = all(getattr(pass_, h) is getattr(ExportPass, h) for h in _NODE_HOOKS)
        cls = _guarded(pass_) if guard else pass_
        transform_pass = cls(ep) if issubclass(pass_, XNNPACKPass) else cls()
        if guard and ep.graph_module is not received:
            transform_pass.unchanged_if = structure(ep.graph_module.graph)
        if _CHECKS_AT_ENDS:
            manager = _EndsChecked([transform_pass], before=i == 0,
                                   after=i == len(self.passes) - 1)
            ep = _transform_with_pass_manager(ep, manager)
        else:
            ep = _transform(ep, transform_pass)
    return ep


_CHECKS_AT_ENDS = False  # xnnpack.checks_at_ends (read by _transform_skipping_retraces)


class _EndsChecked(ExportedProgramPassManager):
    """ExecuTorch's pass manager for one of XNNPACK's passes, checking the program (recompile,
    lint, no call_method, the verifier) before it only if it is the first pass and after it
    only if it is the last: upstream checks before and after every pass, so each check between
    two passes ran twice on the same graph, and a graph a check passes at the end of the list
    passed every check on the way unless a later pass undid what an earlier one broke. A pass
    that rewrites recompiles its graph module either way (the manager does)."""

    def __init__(self, passes, before: bool, after: bool):
        super().__init__(passes)
        self.ends = [before, after]  # __call__ checks twice: before the pass, then after

    def check(self, exported_program):
        if self.ends.pop(0):
            super().check(exported_program)


def _check_at_ends(on: bool) -> None:
    global _CHECKS_AT_ENDS
    _CHECKS_AT_ENDS = on


def _answer_up_front(self, ep):
    """XnnpackPartitioner.ops_to_not_decompose, answered without the check function when every
    node it would check passes: then both of ExecuTorch's paths keep the same nodes, and the one
    taken decomposes the program once instead of three times. When one fails, the check goes to
    ExecuTorch as before. The ops are filtered as the EDGE_DO_NOT_DECOMP path filters them."""
    ops, check = ConfigerationBasedPartitioner.ops_to_not_decompose(self, ep)
    if check is None:
        return ops, check
    kept = set(ops)
    if all(check(n) for n in ep.graph.nodes if n.op == "call_function" and n.target in kept):
        return _remove_invalid_ops_for_not_decompose(list(ops)), None
    return ops, check


def _where_one_can_match(pass_type: type, anchor):
    """`pass_type.call` (a pattern-replacing pass of XNNPACK's) without its patterns when none
    can match: each of its patterns holds an `anchor` node (tested), and `SubgraphMatcher` pairs
    call_function nodes by target, so a graph without one matches nothing; then neither the
    patterns (exports and edge lowerings, once a process) nor the matching (nor the debug-log
    `print_readable`s of the graph) are needed. The graph is recompiled and retraced as
    upstream's `call` ends (`skip_retraces` hands it back)."""
    upstream = pass_type.__dict__["call"]

    def call(self, graph_module):
        if any(n.op == "call_function" and n.target == anchor for n in graph_module.graph.nodes):
            return upstream(self, graph_module)
        graph_module.recompile()
        graph_module = super(pass_type, self).call(graph_module).graph_module
        return PassResult(graph_module, True)
    return call


# upsample: four bilinear patterns; SDPA: two (an LLM's attention is custom_sdpa, outside XNNPACK)
_upsample_where_one_can_match = _where_one_can_match(ConvertToUpsampleBilinear2d, _UPSAMPLE)
_sdpa_where_one_can_match = _where_one_can_match(ConvertToSDPAPass, _SOFTMAX)


class _ReadOnce(ExportGraphSignature):
    """A program's graph signature while the partitioner only reads it: each input mapping
    (`inputs_to_parameters`, ... : upstream builds a new dict over every input per call) built
    once, from the same spec lists."""

    @functools.cached_property
    def inputs_to_parameters(self):
        return ExportGraphSignature.inputs_to_parameters.fget(self)

    @functools.cached_property
    def inputs_to_buffers(self):
        return ExportGraphSignature.inputs_to_buffers.fget(self)

    @functools.cached_property
    def inputs_to_lifted_tensor_constants(self):
        return ExportGraphSignature.inputs_to_lifted_tensor_constants.fget(self)


def _specs(signature) -> tuple:
    return tuple((s.kind, getattr(s.arg, "name", None), s.target)
                 for s in signature.input_specs)


def _partitions_reading_signature_once(self, ep):
    """ConfigerationBasedPartitioner.generate_partitions with the program's signature read
    once: its configs ask, for every node and every argument, whether it is a parameter, buffer
    or constant (`is_param`, `is_constant_data`), and each asks the signature for a new
    dict of every input (a program's inputs x its nodes). Should the signature change meanwhile,
    upstream's runs again on the program as it is."""
    signature = ep._graph_signature
    before = _specs(signature)
    ep._graph_signature = _ReadOnce(input_specs=signature.input_specs,
                                    output_specs=signature.output_specs)
    try:
        partitions = _UPSTREAM_GENERATE(self, ep)
    finally:
        ep._graph_signature = signature
    return partitions if _specs(signature) == before else _UPSTREAM_GENERATE(self, ep)


def _install_shared_weights() -> None:
    """Idempotent: the wrapper calls ExecuTorch's preprocess, never the attribute it replaced."""
    setattr(XnnpackBackend, _COPY_HOOK, classmethod(_copy_sharing_weights))
    XnnpackBackend.preprocess = staticmethod(_preprocess_from_weights)


def _restore_shared_weights() -> None:
    """ExecuTorch's own copy hook (BackendDetails') and preprocess."""
    if _COPY_HOOK in XnnpackBackend.__dict__:
        delattr(XnnpackBackend, _COPY_HOOK)
    XnnpackBackend.preprocess = _UPSTREAM_PREPROCESS


def _restore_ops_to_not_decompose() -> None:
    if "ops_to_not_decompose" in XnnpackPartitioner.__dict__:
        del XnnpackPartitioner.ops_to_not_decompose


def _patch(name, summary, pins, install, restore, installed) -> Patch:
    return Patch(name=f"xnnpack.{name}", summary=summary, written_for={"executorch": "1.5."},
                 pins=pins, install=install, restore=restore, installed=installed)


PATCHES = (
    _patch("shared_weights", "XNNPACK's preprocess shares the weights instead of copying them "
           "twice", {
               "executorch.exir.backend.backend_details:BackendDetails."
               "copy_exported_program_for_preprocess": "161d76674b18cbbd",
               "executorch.backends.xnnpack.xnnpack_preprocess:XnnpackBackend.preprocess":
                   "62f7dc915f1ef40c",
               "executorch.exir._serialize._cord:FileBackedData": "274534a6fc9df21f"},
           _install_shared_weights, _restore_shared_weights,
           lambda: XnnpackBackend.preprocess is _preprocess_from_weights),
    _patch("skip_retraces", "XNNPACK's passes hand back the graphs they left unchanged instead "
           "of retracing them", {
               "executorch.backends.xnnpack._passes:XNNPACKPassManager.transform":
                   "18e3bd06d0a97585",
               "executorch.exir.pass_base:_ExportPassBase.call": "689e39bb23b9834c"},
           **replacing(XNNPACKPassManager, "transform", _transform_skipping_retraces)),
    _patch("checks_at_ends", "XNNPACK's passes check each partition's program before the "
           "first and after the last instead of before and after every pass", {
               "executorch.exir.pass_manager:ExportedProgramPassManager.__call__":
                   "ef226dd21756330d",
               "executorch.exir.pass_manager:ExportedProgramPassManager.check":
                   "a2cab355650bc461",
               "executorch.exir.program._program:_transform": "9359d02c126f183c"},
           lambda: _check_at_ends(True), lambda: _check_at_ends(False),
           lambda: _CHECKS_AT_ENDS),
    _patch("one_decomposition", "the XNNPACK partitioner answers without a check function when "
           "every node passes it: one decomposition of the program instead of three", {
               "executorch.exir.backend.canonical_partitioners.config_partitioner:"
               "ConfigerationBasedPartitioner.ops_to_not_decompose": "9713395f05ceec1b",
               "executorch.exir.program._program:_gen_edge_manager_for_partitioners":
                   "14a2b38bd338a215",
               "executorch.exir.program._program:_remove_invalid_ops_for_not_decompose":
                   "3e17892fc8dbf7d8"},
           lambda: setattr(XnnpackPartitioner, "ops_to_not_decompose", _answer_up_front),
           _restore_ops_to_not_decompose,
           lambda: XnnpackPartitioner.__dict__.get("ops_to_not_decompose") is _answer_up_front),
    _patch("signature_read_once", "the partitioner reads the program's parameters, buffers and "
           "constants from one mapping each instead of a new one per question", {
               "executorch.exir.backend.canonical_partitioners.config_partitioner:"
               "ConfigerationBasedPartitioner.generate_partitions": "193664b914092e8e",
               "torch.export.graph_signature:ExportGraphSignature": "d63e7b85b182a5e1",
               "torch.export.exported_program:ExportedProgram.graph_signature.fget":
                   "c72be401dbe2cec6"},
           **replacing(ConfigerationBasedPartitioner, "generate_partitions",
                       _partitions_reading_signature_once)),
    _patch("unmatchable_patterns", "XNNPACK's upsample pass neither builds nor matches its "
           "patterns in a partition without an upsample", {
               "executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d:"
               "ConvertToUpsampleBilinear2d.call": "d6d9c859f8b87991",
               "executorch.backends.xnnpack.partition.graphs.bilinear_2d:"
               "_get_bilinear_2d_graphs": "77141bc03a50d7d1",
               "torch.fx.passes.utils.matcher_utils:SubgraphMatcher._nodes_are_equal":
                   "b3cf5de7a34912b7"},
           **replacing(ConvertToUpsampleBilinear2d, "call", _upsample_where_one_can_match)),
    _patch("unmatchable_sdpa", "XNNPACK's SDPA pass neither builds nor matches its patterns in "
           "a partition without a softmax", {
               "executorch.backends.xnnpack._passes.convert_to_sdpa:ConvertToSDPAPass.call":
                   "4a789124b2f94fae",
               "executorch.backends.xnnpack.partition.graphs.sdpa:get_graphs":
                   "665b47517d50bd9e",
               "torch.fx.passes.utils.matcher_utils:SubgraphMatcher._nodes_are_equal":
                   "b3cf5de7a34912b7"},
           **replacing(ConvertToSDPAPass, "call", _sdpa_where_one_can_match)),
)
