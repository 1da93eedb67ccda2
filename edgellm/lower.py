"""The one lowering path: `to_edge_transform_and_lower` for any ordered chain of backends.

Every backend's partitioners go in as one list, so each partitioner's `ops_to_not_decompose` is
honoured (the `to_edge` + `to_backend` split decomposes those ops first, and breaks on mutable
buffers). Deprecation warnings raised while lowering are counted for the report.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.export import ExportedProgram
from torch.utils._pytree import tree_leaves

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
                    "fusion.branch_delegates", "partition.lean_dependencies",
                    "emit.constants_by_reference",
                    "emit.functionalization_removed_once")


class BranchOutputsInPlace:
    """ExecuTorch's memory planning (its `MemoryPlanningAlgorithmSuite`), then every torch.cond
    branch's outputs placed where the cond's own outputs are planned, so that a branch writes its
    result there. Upstream plans them in the arena every control-flow branch shares and moves
    the cond's value onto them (MoveCall, a pointer): a second cond run while the first one's
    result is still to be read overwrites it (ExecuTorch issue 21490, open in 1.5.1), which is
    what `--experts chosen` does, a cond per expert, their results summed after. The outer
    planning already gives each cond output its own place for as long as it is read."""

    def __init__(self):
        from executorch.exir.memory_planning import MemoryPlanningAlgorithmSuite

        self.inner = MemoryPlanningAlgorithmSuite()

    def __call__(self, alignment, specs, graph_module, *args, **kwargs) -> list[int]:
        sizes = self.inner(alignment, specs, graph_module, *args, **kwargs)
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target is not torch.ops.higher_order.cond:
                continue
            outers = tree_leaves(node.meta["spec"])
            for branch in node.args[1:3]:
                made = tree_leaves(getattr(graph_module, branch.target).graph.output_node().args)
                for inner, outer in zip(made, outers, strict=True):
                    inner.meta["spec"].mem_id = outer.mem_id
                    inner.meta["spec"].mem_offset = outer.mem_offset
        return sizes


def tag_constants(gm: torch.fx.GraphModule, tag: str):
    """Every placeholder of the edge program marked for `{tag}.ptd` in the field delegates read
    (`delegate_constant_tag`: XNNPACK serializes a weight it takes into that file, not its
    payload), after the decompositions (which drop placeholders' custom meta) and before
    partitioning, whose subgraphs copy it. A delegate reads it only on constants; the program's
    own constants go by ExecutorchBackendConfig's `external_constants`."""
    from executorch.exir.pass_base import PassResult

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = tag
    return PassResult(gm, True)


class _Scaled(torch.nn.Module):
    """What an expert delegate keeps as its program (lower_experts): the expert's signature and
    output, `x * w` of shape (N, D), and no weights."""

    def forward(self, x, w):
        return (x * w,)


def lower_experts(model, make_partitioners: Callable[[], list], max_tokens: int,
                  progress: Callable[[int, int], None] = lambda done, total: None) -> int:
    """Each expert of the sparse blocks `--experts chosen` quantized (SparseMoE.each, or, left
    for now, SparseMoE.pending: quantized here a block at a time) lowered to a delegate of its
    own, for calls of 1..max_tokens tokens, with the first backend's partitioners
    (`make_partitioners` makes a fresh list per block); each block then calls its delegates
    behind a torch.cond apiece (SparseMoE.use_delegates), which the program's export traces.

    A block's experts are one graph with different weights: the first is exported and taken to
    the edge dialect as `to_edge_transform_and_lower` does (decomposed as its partitioners ask),
    and that edge program, with each expert's weights put in turn under its weights' names, is
    what each expert's `to_backend` lowers: the export and decompositions once a block, not once
    an expert.

    The program's trace makes a delegate's outputs by running the delegate's program on fake
    tensors, which the real program's weights are not; and those weights would stay in memory
    beside the delegate's own copy. So each delegate keeps a stand-in program (`_Scaled`: the
    same inputs and output) which holds the real one's op counts for the report (meta
    "delegated_ops"). `progress(done, total)` after each block. Returns the delegates made."""
    from executorch.exir import EdgeCompileConfig

    from .architectures.moe import SparseMoE
    from .memory import release_memory
    from .quantize.experts import quantize_block
    from .report import op_counts

    blocks = [m for m in model.modules()
              if isinstance(m, SparseMoE) and (hasattr(m, "each") or m.pending)]
    total, made = sum(b.routing.experts for b in blocks), 0
    config = EdgeCompileConfig(_check_ir_validity=False)
    dims = None
    if max_tokens > 1:
        tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
        dims = ({0: tokens}, {0: tokens})
    for block in blocks:
        if block.pending:
            quantize_block(block)
        dtype, n = block.gate.weight.dtype, min(2, max_tokens)
        example = (torch.zeros(n, block.hidden, dtype=dtype), torch.zeros(n, 1, dtype=dtype))
        stand_in = _export_edge(_Scaled(), example, dims, [], config).exported_program()
        partitioners = make_partitioners()
        edge = _export_edge(block.each[0], example, dims, partitioners, config, lower=False)
        lowered = [_expert_delegate(edge, expert, partitioners) for expert in block.each]
        # the experts are alike: the stand-in keeps the first one's ops
        stand_in.graph_module.meta["delegated_ops"] = op_counts(
            lowered[0].original_module.graph_module)
        for delegate in lowered:
            delegate._original_exported_program = stand_in
        block.use_delegates(lowered)
        del edge, lowered
        forget_lowered_graphs()  # which hold the block's quantized experts, lowered now
        release_memory()
        made += block.routing.experts
        progress(made, total)
    return made


def _expert_delegate(edge, expert: torch.nn.Module, partitioners: list):
    """`edge` (an expert's EdgeProgramManager, not lowered) with `expert`'s weights, lowered by
    `partitioners` in turn -> its one delegate, which must have taken the whole expert from
    the inputs (x, w) in that order."""
    program = edge.exported_program()
    weights = _flat_weights(expert)
    if {k: (t.shape, t.dtype) for k, t in weights.items()} != {
            k: (t.shape, t.dtype) for k, t in program.state_dict.items()}:
        raise RuntimeError(f"an expert's weights {sorted(weights)} are not the ones its exported "
                           f"program names ({sorted(program.state_dict)})")
    program.state_dict.update({k: torch.nn.Parameter(t, requires_grad=False)
                               for k, t in weights.items()})
    partitioning = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    partitioning.addFilter(_not_a_split_workflow)
    try:
        with count_deprecations([], []), torch.no_grad():
            for partitioner in partitioners:
                edge = edge.to_backend(partitioner)
    finally:
        partitioning.removeFilter(_not_a_split_workflow)
    graph = edge.exported_program()
    nodes = list(graph.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"][-2:]  # the user inputs, after weights
    calls = [n for n in nodes if n.op == "call_function" and "call_delegate" in str(n.target)]
    left = sorted({getattr(n.target, "__name__", str(n.target)) for n in nodes
                   if n.op == "call_function" and n.target is not operator.getitem
                   and n not in calls})
    if left or len(calls) != 1 or list(calls[0].args[1:]) != inputs:
        raise RuntimeError(f"the partitioners did not take the expert whole, from (x, w), in one "
                           f"delegate (left outside: {left}, delegates: {len(calls)}): "
                           "--experts chosen needs it so")
    return getattr(graph.graph_module, calls[0].args[0].target)


def _not_a_split_workflow(record: logging.LogRecord) -> bool:
    """XNNPACK's partitioner warns of the deprecated `to_edge() + to_backend()` split whenever
    `to_edge_transform_and_lower` is not on the stack; an expert's edge program is that call's
    own first step (decomposed as its partitioners ask), so the warning, once an expert, is
    wrong here and dropped."""
    return "'to_edge() + to_backend()'" not in record.getMessage()


def _flat_weights(module: torch.nn.Module) -> dict:
    """`module`'s parameters as torch.export names them in its program: a tensor subclass
    (torchao's quantized weight) as torch's own unwrapping gives its plain tensors, each
    `<owner>.parametrizations.<name>.original<k>`."""
    from torch._functorch._aot_autograd.subclass_parametrization import UnwrapTensorSubclass
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out = {}
    for name, tensor in module.named_parameters():
        if not is_traceable_wrapper_subclass(tensor):
            out[name] = tensor
            continue
        owner, _, attr = name.rpartition(".")
        prefix = f"{owner}.parametrizations.{attr}" if owner else f"parametrizations.{attr}"
        for k, part in enumerate(UnwrapTensorSubclass().right_inverse(tensor)):
            out[f"{prefix}.original{k}"] = part
    return out


def _export_edge(module, example: tuple, dims, partitioners: list, config, lower: bool = True):
    """`module` exported and taken to the edge dialect as `to_edge_transform_and_lower` does, and
    lowered by `partitioners` unless `lower` is False -> its EdgeProgramManager; its warnings
    are the program's lowering's too, counted there."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.program import _program

    with count_deprecations([], []), torch.no_grad():
        program = torch.export.export(module, example, dynamic_shapes=dims, strict=False)
        if not lower:  # to_edge_transform_and_lower's first step, what its partitioners lower
            return _program._gen_edge_manager_for_partitioners(
                {"forward": partitioners}, {"forward": program}, config, {})
        return to_edge_transform_and_lower(program, partitioner=partitioners or None,
                                           compile_config=config)


def lower(programs: dict[str, ExportedProgram], partitioners: list, constant_methods: dict,
          etrecord: bool, quant_fusion: bool = False, dedupe: bool = False,
          external: str | None = None) -> Lowered:
    """external: the data file (`{external}.ptd`) every weight goes to, the delegates' and the
    program's own, instead of model.pte; the same bytes under two names (a tied table and its
    head) are stored there once (ExecuTorch's NamedDataStore keeps a buffer per content).
    quant_fusion: rewrite torchao's dequantize + embedding left outside the delegates into
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
            transform_passes=([CSEPass()] if dedupe else []) + (
                [lambda gm: tag_constants(gm, external)] if external else []) or None,
            generate_etrecord=etrecord)
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
        external_constants=(lambda node: external) if external else False,
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        memory_planning_pass=MemoryPlanningPass(memory_planning_algo=BranchOutputsInPlace(),
                                                share_mutable_buffers=len(programs) > 1)))
    forget_lowered_graphs()
    return Lowered(program=program, delegation=figures, preserved=fates,
                   deprecations=logged, python_deprecations=python, states=states)
