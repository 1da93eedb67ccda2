"""The one lowering path: `to_edge_transform_and_lower` for any ordered chain of backends.

Every backend's partitioners go in as one list, so each partitioner's `ops_to_not_decompose` is
honoured (the `to_edge` + `to_backend` split decomposes those ops first, and breaks on mutable
buffers). Deprecation warnings raised while lowering are counted for the report.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field

from torch.export import ExportedProgram

DEPRECATION_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


@dataclass
class Lowered:
    program: object  # ExecutorchProgramManager
    delegation: dict  # method -> delegation figures, taken before to_executorch rewrites the graph
    preserved: list[dict] = field(default_factory=list)  # per partitioner: ops kept whole, and fate
    deprecations: list[str] = field(default_factory=list)  # logged deprecation warnings
    python_deprecations: list[str] = field(default_factory=list)  # warnings-module ones, distinct
    # method -> {buffer fqn: {"shape", "dtype", "kept_by_executorch"}} for every mutable buffer
    states: dict = field(default_factory=dict)


class _DeprecationLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if "deprecat" in text.lower():
            self.messages.append(f"{record.name}: {text}")


@contextlib.contextmanager
def count_deprecations(logged: list[str], python: list[str]):
    """Collect deprecation warnings raised inside the block: those logged through `logging` (how
    ExecuTorch reports a deprecated workflow) into `logged`, and distinct warnings-module ones
    (mostly from inside coremltools and torch) into `python`."""
    handler = _DeprecationLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        root.removeHandler(handler)
    logged.extend(handler.messages)
    for w in caught:
        msg = f"{w.category.__name__}: {w.message}"
        if issubclass(w.category, DEPRECATION_CATEGORIES) and msg not in python:
            python.append(msg)


def record_preserved(partitioners: list) -> list[dict]:
    """Wrap each partitioner's `ops_to_not_decompose` so the ops it asks to keep whole, as
    answered inside the lowering call on the functionalized graph, are recorded for the report."""
    records = []
    for p in partitioners:
        entry = {"partitioner": type(p).__name__, "ops": []}
        records.append(entry)

        def recording(ep, _inner=p.ops_to_not_decompose, _entry=entry):
            keep, check = _inner(ep)
            _entry["ops"] = sorted(set(_entry["ops"]) | {str(op) for op in keep})
            return keep, check

        p.ops_to_not_decompose = recording
    return records


def mutable_buffers(ep: ExportedProgram) -> dict[str, dict]:
    """The buffers a program writes, with the shape and dtype they enter it with. The exported
    program is not functionalized yet, so writes are found as arguments an op's schema marks as
    written (copy_, index_put_, llama::update_cache, ...)."""
    buffers = {n: ep.graph_signature.inputs_to_buffers[n.name] for n in ep.graph.nodes
               if n.op == "placeholder" and n.name in ep.graph_signature.inputs_to_buffers}
    out = {}
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in buffers:
                val = value.meta["val"]
                out[buffers[value]] = {"shape": list(val.shape),
                                       "dtype": str(val.dtype).removeprefix("torch.")}
    return dict(sorted(out.items()))


def forget_lowered_graphs() -> None:
    """Drop what ExecuTorch's modules keep of the last lowering, which holds the edge program with
    every weight (the mmapped checkpoint's pages would stay resident through verification):
    module-level `WhyNoPartition` loggers keep the last rejected node, and `lru_cache`d helpers
    such as `exir.backend.utils.is_same_node` are keyed by nodes. Caches only recompute; those of
    functions without arguments (XNNPACK's pattern graphs, built once a process) hold no graph
    of ours and stay."""
    import sys

    from executorch.exir.backend.utils import WhyNoPartition

    for name, module in list(sys.modules.items()):
        if not name.startswith("executorch.") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, WhyNoPartition):
                value.node = None
            elif (callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info")
                  and _takes_arguments(value)):
                value.cache_clear()


def _takes_arguments(cached) -> bool:
    import inspect

    try:
        return bool(inspect.signature(getattr(cached, "__wrapped__", cached)).parameters)
    except (TypeError, ValueError):  # no signature to read: clear it
        return True


# edgellm.patches every lowering runs with, whatever the backends (theirs: Backend.patches)
LOWERING_PATCHES = ("exir.composite_fake_runs", "exir.kept_op_fake_runs",
                    "exir.chained_edge_passes", "exir.one_decomposition_trace",
                    "exir.legalize_in_place", "exir.delegate_fake_outputs",
                    "emit.constants_by_reference")


def lower(programs: dict[str, ExportedProgram], partitioners: list, constant_methods: dict,
          etrecord: bool, quant_fusion: bool = False, dedupe: bool = False) -> Lowered:
    """quant_fusion: rewrite torchao's dequantize + embedding left outside the delegates into
    ExecuTorch's quantized embedding kernels (`embedding_byte` / `embedding_4bit`), as
    export_llm does; without it `to_executorch` finds no out variant for dequantize_affine.
    dedupe: ExecuTorch's CSEPass before partitioning, which merges the block sums that linears
    reading the same input each compute (quantize.grid.GridLinear: q, k and v share one)."""
    from executorch.exir import (EdgeCompileConfig, ExecutorchBackendConfig,
                                 to_edge_transform_and_lower)
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.cse_pass import CSEPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    from .memory import release_memory
    from .report import delegation, op_histogram, preserved_report

    ops_before = op_histogram(programs)
    states = {name: mutable_buffers(ep) for name, ep in programs.items()}
    logged: list[str] = []
    python: list[str] = []
    preserved = record_preserved(partitioners)
    with count_deprecations(logged, python):
        edge = to_edge_transform_and_lower(
            programs, partitioner=partitioners or None, constant_methods=constant_methods,
            # llama:: custom ops are not core ATen; ExecuTorch's own LLM export skips this check too
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            transform_passes=[CSEPass()] if dedupe else None, generate_etrecord=etrecord)
    figures = {name: delegation(edge.exported_program(name).graph_module) for name in programs}
    fates = preserved_report(preserved, ops_before, edge)
    for name in programs:  # a buffer a delegate took over is no longer the program's to write
        kept = set(edge.exported_program(name).graph_signature.buffers_to_mutate.values())
        for fqn, facts in states[name].items():
            facts["kept_by_executorch"] = fqn in kept
    # Plan memory for the largest T the program accepts, not for the example input's T. With
    # several methods, each buffer gets one place that every method reads and writes (one
    # MemoryPlanningPass instance plans them all).
    # lowering leaves garbage in cycles (copies of programs, fake tensors): collect it before the
    # emitter copies every undelegated constant
    release_memory()
    program = edge.to_executorch(ExecutorchBackendConfig(
        do_quant_fusion_and_const_prop=quant_fusion,
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=len(programs) > 1)))
    forget_lowered_graphs()
    return Lowered(program=program, delegation=figures, preserved=fates,
                   deprecations=logged, python_deprecations=python, states=states)
