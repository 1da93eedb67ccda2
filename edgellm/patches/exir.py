"""Patches of ExecuTorch 1.5's lowering (and torch.export's older pass base it still uses):
fewer fake runs, retraces and decompositions of the whole graph, the same program.

`exir.composite_fake_runs`: every ExportPass retraces its graph: each node's op runs again on
fake tensors to give the new node its metadata. torchao's quantize primitives
(`choose_qparams_affine`, `quantize_affine`, `dequantize_affine`) and the ATen ops a partitioner
keeps whole (`linear`, which XNNPACK keeps) are CompositeImplicitAutograd ops, so each of those
runs is their Python body: twenty-odd ATen ops for a quantize op, `matmul`'s symbolic
reshaping for a linear. An 8da4w program holds four of the first per linear, and lowering
retraces it some twenty times (aten-to-edge passes, XNNPACK's passes, `to_executorch`).
A fake run of such an op has no data: its outputs' shapes, strides and dtypes follow from its
inputs' and its other arguments, which is what ExecuTorch keeps from the run. `_Remembering`
keeps them per fake mode (the symbolic sizes belong to its ShapeEnv) and answers a repeat with
new empty fake tensors of the same metadata. Only functional composite ops, only when every
tensor argument is a fake tensor of one mode; anything else runs as before. It wraps `_fx` of
ExecuTorch's ExportPass and of torch.export's older pass base.

`exir.kept_op_fake_runs`: the same fake runs in torch.export's decomposition. It keeps an op the
partitioner asked for by registering, for the trace, a fake-tensor rule that runs the op's
Python body (`_override_composite_implicit_decomp`), and AOT traces twice (a metadata pass, then
the graph): each torchao quantize op's body ran twice per node. The rule it registers now
remembers, in the same memo per fake mode.

`exir.chained_edge_passes`: ExecuTorch's aten-to-edge conversion (`_generate_edge_program`) runs
its passes one after another, and seven of them are ExportPasses that rewrite node by node in
`call_operator` alone (NormalizeTranspose, ReplaceBrokenOps, ScalarToTensor, SymToTensor, then,
after four passes that edit the graph in place, RemoveMixedTypeOperators, OpReplace,
MemoryFormatOps): seven retraces of the whole graph, about 4 s each on the embedded SmolLM2's 30
layers. Consecutive ones run as one retrace (`_Chained`): each pass's closing
`super().call_operator` hands the op to the next pass's `call_operator` instead of adding a node,
and the last adds it. A pass sees each op as it would in its own retrace: after every earlier
pass, before any later one, with the arguments already rebuilt by all of them; ops a pass inserts
go through the passes after it only. Same nodes, names and metadata: the .pte is the same.

`exir.one_decomposition_trace`: `to_edge_transform_and_lower` functionalizes each program
(`run_decompositions({})`, a whole AOT trace), asks the partitioner which ops to keep, and
decomposes the rest (a second trace). A configuration-based partitioner's (XNNPACK's) kept ops
come from its configs, not from the graph: one trace with the same table does both, and the
partitioner is asked again on the result; if it answers with a check function there (a node
fails it), upstream's path runs instead (the trace spent). Partitioners that list the ops of the
graph they are shown (Core ML's) or always answer with a check (Vulkan's) go upstream's way.

`exir.legalize_in_place`: `create_submodule_from_nodes`, once per partition, re-sorts the whole
program topologically (`legalize_graph`): every node copied into a new graph, then the graph
module recompiled, a cost of partitions x nodes. The same Kahn order is made by moving the
program's own nodes, with what a copy would change made alike (users and inputs in the new
order, a fresh namespace), and no recompile: ExecuTorch builds a new graph module from the
graph before anything runs its code.

`exir.delegate_fake_outputs`: a retrace of a program that holds delegates (two of
`to_executorch`'s passes) makes each delegate's outputs by running the delegate's whole
original program on fake tensors (`call_delegate_cpu`): a fake run of the entire model, twice.
The delegate's program already holds its outputs' metadata; each symbolic size there is one of
its inputs' symbols, which this call's arguments give. Where that does not hold (a size that is
an expression, strides that are not contiguous, mutated buffers), upstream's run.
"""

from __future__ import annotations

import collections
import copy
import functools
import importlib
import operator
import weakref
from collections import defaultdict

import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from executorch.exir.pass_base import ExportPass, _ExportPassBase
from executorch.exir.program import _program
from torch._export.pass_base import _ExportPassBaseDeprecatedDoNotUse
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_leaves, tree_unflatten

from . import Patch, replacing

# ExecuTorch's ExportPass and torch.export's older one (ReplaceViewOpsWithViewCopyOpsPass)
# build each node the same way: `_fx` runs the op through `self.interpreter`, then adds the node
_PASS_BASES = (_ExportPassBase, _ExportPassBaseDeprecatedDoNotUse)
_UPSTREAM_FX = {base: base.__dict__["_fx"] for base in _PASS_BASES}
# fake mode -> {(op, arguments' metadata): outputs' metadata}; an entry goes with its mode
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def memoizable(op) -> bool:
    """A functional op that runs as its Python decomposition (a torchao quantize op, or an ATen
    op a partitioner kept whole: `linear`), as an ATen-dialect target or wrapped as an edge
    op."""
    if isinstance(op, EdgeOpOverload):
        op = op._op
    return (isinstance(op, torch._ops.OpOverload)
            and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                               "CompositeImplicitAutograd")
            and not op._schema.is_mutable
            and all(r.alias_info is None for r in op._schema.returns))


def metadata(value):
    """What a fake run can depend on: tensors' sizes (symbolic ones as expressions), strides,
    dtype, device and grad flag; everything else by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(metadata(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, metadata(v)) for k, v in sorted(value.items())))
    return ("value", repr(value))


def _like(spec):
    shape, stride, dtype, device, grad = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=device, requires_grad=grad)


def _remembered(seen: dict, key, run):
    """`run()`'s outputs, or new fake tensors of the metadata `run()` gave for `key` before
    (made in the fake mode that is current: the caller's). Remembered only when every output
    is a fake tensor whose sizes hold no data-dependent (unbacked) symbol and whose storage
    starts at its first element."""
    found = seen.get(key)
    if found is not None:
        several, specs = found
        return tuple(map(_like, specs)) if several else _like(specs[0])
    result = run()
    several = isinstance(result, tuple)
    results = result if several else (result,)
    if all(isinstance(r, FakeTensor) and r.storage_offset() == 0
           and not free_unbacked_symbols(r) for r in results):
        seen[key] = (several, tuple((r.shape, r.stride(), r.dtype, r.device, r.requires_grad)
                                    for r in results))
    return result


class _Remembering:
    """Stands in for ExportPass's interpreter for one call_function."""

    def __init__(self, interpreter, seen: dict):
        self.interpreter, self.seen = interpreter, seen

    def call_function(self, target, args, kwargs):
        return _remembered(self.seen, (target, metadata(args), metadata(kwargs)),
                           lambda: self.interpreter.call_function(target, args, kwargs))


def _remembering(upstream):
    def _fx(self, kind, target, args, kwargs, meta):
        if kind == "call_function" and memoizable(target):
            data = [getattr(a, "data", a) for a in tree_leaves((args, kwargs))]
            tensors = [t for t in tree_leaves(data) if isinstance(t, torch.Tensor)]
            modes = {id(t.fake_mode) for t in tensors if isinstance(t, FakeTensor)}
            if tensors and len(modes) == 1 and all(isinstance(t, FakeTensor) for t in tensors):
                real = self.interpreter
                self.interpreter = _Remembering(real,
                                                _SEEN.setdefault(tensors[0].fake_mode, {}))
                try:
                    return upstream(self, kind, target, args, kwargs, meta)
                finally:
                    self.interpreter = real
        return upstream(self, kind, target, args, kwargs, meta)
    return _fx


_MEMOIZED_FX = {base: _remembering(fx) for base, fx in _UPSTREAM_FX.items()}

# torch.export's decomposition keeps a composite op a partitioner asked for (torchao's quantize
# ops, linear) by registering, for the trace, a fake-tensor rule that runs the op's Python body
# (`_override_composite_implicit_decomp`); it registers through this module's name
_EXPORTED_PROGRAM = importlib.import_module("torch.export.exported_program")
_UPSTREAM_REGISTER = _EXPORTED_PROGRAM.register_op_impl


def _register_remembering(op):
    """`register_op_impl(op)` for torch.export's kept composite ops: the rule registered
    answers a repeat of the same metadata from its first run in the same fake mode."""
    register = _UPSTREAM_REGISTER(op)
    if not memoizable(op):
        return register

    def registering(rule):
        def remembering(fake_mode, func, *args, **kwargs):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not tensors or not all(isinstance(t, FakeTensor) and t.fake_mode is fake_mode
                                      and t.constant is None for t in tensors):
                return rule(fake_mode, func, *args, **kwargs)
            with fake_mode:  # the rule runs inside the mode's dispatch, the mode not current
                return _remembered(_SEEN.setdefault(fake_mode, {}),
                                   (func, metadata(args), metadata(kwargs)),
                                   lambda: rule(fake_mode, func, *args, **kwargs))
        return register(remembering)
    return registering


class _Chained(ExportPass):
    """Several ExportPasses that rewrite only in `call_operator`, in one retrace."""

    def __init__(self, passes: list) -> None:
        super().__init__()
        self.passes = passes

    def call(self, graph_module):
        """The retrace, with each pass handing its ops on (the pass objects are ExecuTorch's
        shared ones: they are handed back as they were)."""
        for here, after in zip(self.passes, self.passes[1:] + [None]):
            here._fx = self._handing_to(after)
        try:
            return super().call(graph_module)
        finally:
            for here in self.passes:
                del here._fx

    def call_operator(self, op, args, kwargs, meta):
        return self.passes[0].call_operator(op, args, kwargs, meta)

    def _handing_to(self, after):
        """A chained pass's `_fx`: an op goes to the next pass as that pass's own retrace would
        give it (ExportPass's interpreter calls `call_operator` for ATen and edge ops); the last
        pass's ops, and anything that is not an op (getitem, symbolic arithmetic, the output:
        none of the chained passes rewrites those), are added to the graph here."""
        def _fx(kind, target, args, kwargs, meta):
            if after is not None and kind == "call_function" and isinstance(
                    target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                             EdgeOpOverload)):
                return after.call_operator(target, args, kwargs, meta)
            return self._fx(kind, target, args, kwargs, meta)
        return _fx

    def __repr__(self) -> str:
        return f"_Chained({', '.join(type(p).__name__ for p in self.passes)})"


def _chainable(p) -> bool:
    from executorch.exir.passes.memory_format_ops_pass import MemoryFormatOpsPass
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
    from executorch.exir.passes.replace_aten_with_edge_pass import OpReplacePass
    from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import (
        ReplaceBrokenOpsWithFunctionalOpsPass)
    from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
    from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass

    return type(p) in (NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass,
                       ScalarToTensorPass, SymToTensorPass, RemoveMixedTypeOperators,
                       OpReplacePass, MemoryFormatOpsPass)


def chained(passes: list) -> list:
    """`passes` with each run of two or more consecutive chainable passes as one `_Chained`
    (ExecuTorch's pass manager wraps the first ones to return a PassResult, which they do)."""
    out, run = [], []
    for p in [*passes, None]:
        if p is not None and _chainable(getattr(p, "__wrapped__", p)):
            run.append(getattr(p, "__wrapped__", p))
            continue
        out += [_Chained(run)] if len(run) > 1 else run
        run = []
        if p is not None:
            out.append(p)
    return out


def _generate_edge_program(config, program, core_aten_ops_exception_list=None,
                           preserve_ops=None):
    """ExecuTorch 1.5's `_generate_edge_program` (pinned), its pass loop over `chained(passes)`."""
    P = _program
    program = P.remove_unused_parameters_pass(program)
    pre_op_replace_passes, post_op_replace_passes = P._get_aten_to_edge_passes(config)
    passes = [P.RemoveNonCoreAtenOpGraphAssertsPass(), P.ReplaceViewOpsWithViewCopyOpsPass()]
    passes.extend(pre_op_replace_passes)
    passes.append(P.OpReplacePass())
    if not config._skip_dim_order:
        passes.append(P.MemoryFormatOpsPass())
    gm = program.graph_module
    for p in chained(passes):
        gm_res = p(gm)
        assert gm_res is not None
        gm = gm_res.graph_module
    edge_program = P.ExportedProgram(
        root=gm, graph=gm.graph,
        graph_signature=P._get_updated_graph_signature(program.graph_signature, gm),
        state_dict=program.state_dict, range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph, example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[P.EXIREdgeDialectVerifier(
            edge_compile_config=config, class_only=True,
            core_aten_ops_exception_list=core_aten_ops_exception_list,
            preserve_ops=preserve_ops)])
    edge_program = P.lift_constant_tensor_pass(edge_program)
    edge_program = P.convert_constant_dim_order_pass.convert_constant_dim_order_pass(edge_program)
    return P._transform(edge_program, *post_op_replace_passes)


def _decomposed_once(program, partitioners: list):
    """(program, ops preserved) from one `run_decompositions` that functionalizes and decomposes
    together, keeping the ops the program's one partitioner names. Only for a configuration-based
    partitioner (XNNPACK's), whose ops come from its configs, not from the graph (Core ML's list
    the ops of the program they are shown). Tried when it answers `ops_to_not_decompose` without
    a check function, or with one that a node of the traced program fails (a cast that the
    decomposition removes hides a weight: the decomposed program may pass); taken when it then
    answers on the result without one, naming the same ops. Else None, upstream's
    decompositions follow (a check every traced node passes: XNNPACK's without
    `xnnpack.one_decomposition`)."""
    from executorch.exir.backend.canonical_partitioners.config_partitioner import (
        ConfigerationBasedPartitioner)

    P = _program
    if len(partitioners) != 1 or not isinstance(partitioners[0],
                                                ConfigerationBasedPartitioner):
        return None
    (partitioner,) = partitioners
    ops, check = partitioner.ops_to_not_decompose(program)
    if check is not None:
        kept = set(ops)
        if all(check(n) for n in program.graph.nodes
               if n.op == "call_function" and n.target in kept):
            return None
        ops = P._remove_invalid_ops_for_not_decompose(list(ops))  # as `_answer_up_front` gives
    table = P._default_decomposition_table()
    preserved = [op for op in ops if table.pop(op, None) is not None]
    decomposed = program.run_decompositions(table)
    again, check = partitioner.ops_to_not_decompose(decomposed)
    if check is not None or list(again) != ops:
        return None
    return decomposed, preserved


def _gen_edge_manager_for_partitioners(partitioner, aten_programs, config, constant_methods,
                                       generate_etrecord=False):
    """ExecuTorch 1.5's `_gen_edge_manager_for_partitioners` (pinned), a program decomposed by
    `_decomposed_once` where it can be; the rest as upstream."""
    P = _program
    ops_set_to_not_decompose_by_program = defaultdict(list)
    edge_programs = {}
    for name, program in aten_programs.items():
        partitioners_for_program = partitioner.get(name, []) if partitioner is not None else []
        program = P._apply_pre_decomposition_transforms(program, partitioners_for_program)
        once = (_decomposed_once(program, partitioners_for_program)
                if partitioner is not None else None)
        if once is not None:
            program, ops_set_to_not_decompose_by_program[name] = once
        else:
            program = _upstream_decompositions(program, partitioner, partitioners_for_program,
                                               name, config, ops_set_to_not_decompose_by_program)
        edge_programs[name] = P._generate_edge_program(
            config, program, preserve_ops=ops_set_to_not_decompose_by_program.get(name, []))

    all_ops_not_to_decompose = list(set().union(*ops_set_to_not_decompose_by_program.values()))
    config._core_aten_ops_exception_list = list(
        set(config._core_aten_ops_exception_list) | set(all_ops_not_to_decompose))
    edge_manager = P.EdgeProgramManager(edge_programs, constant_methods, config,
                                        all_ops_not_to_decompose)
    if generate_etrecord:
        etrecord = P._create_empty_etrecord()
        etrecord.add_exported_program(aten_programs)
        etrecord.add_edge_dialect_program(copy.deepcopy(edge_manager))
        edge_manager._etrecord = etrecord
    return edge_manager


def _upstream_decompositions(program, partitioner, partitioners_for_program, name, config,
                             ops_set_to_not_decompose_by_program):
    """The loop body of upstream's `_gen_edge_manager_for_partitioners`, as it is there."""
    P = _program
    # Functionalize program before asking partitioners to preserve ops
    program = program.run_decompositions({})
    if partitioner is not None:
        final_ops_to_preserve = set()
        if not partitioners_for_program:
            table = P._default_decomposition_table()
            for op in config.preserve_ops:
                table.pop(op, None)
            program = program.run_decompositions(table)
        for curr_partitioner in partitioners_for_program:
            curr_ops_no_decomp, _ = curr_partitioner.ops_to_not_decompose(program)
            if P._can_skip_using_EDGE_DO_NOT_DECOMP(curr_partitioner, program):
                table = P._default_decomposition_table()
                ops_needing_preservation = []
                for op in curr_ops_no_decomp:
                    if table.pop(op, None) is not None:
                        ops_needing_preservation.append(op)
                if P.contains_any_call_fn_target_op(program.graph_module, table):
                    program = program.run_decompositions(table)
                final_ops_to_preserve.update(ops_needing_preservation)
            else:
                curr_ops_no_decomp = P._remove_invalid_ops_for_not_decompose(curr_ops_no_decomp)
                table = P._default_decomposition_table()
                for op in curr_ops_no_decomp:
                    table.pop(op, None)
                program = program.run_decompositions(table)
                temp_partitioner_dict = {name: [curr_partitioner]}
                preserved_ops = (P._replace_aten_ops_with_transformed_ops(
                    name, program, temp_partitioner_dict) or [])
                final_ops_to_preserve.update(preserved_ops)
                program = program.run_decompositions(P._default_decomposition_table())
                P._restore_transformed_ops_to_aten_ops(program)
        ops_set_to_not_decompose_by_program[name].extend(final_ops_to_preserve)
    return program


def _delegate_outputs(lowered_module, *args):
    """`call_delegate_cpu` where every tensor argument is a fake tensor: the outputs made from the
    delegate's own program (its output nodes' metadata, each symbolic size put in terms of this
    call's arguments), instead of running that program on the fake tensors. Anything this cannot
    map (a size that is an expression, strides that are not contiguous, mutated buffers, a
    non-tensor output) runs upstream's."""
    outputs = _outputs_from_metadata(lowered_module.original_module, args)
    if outputs is None:
        return _UPSTREAM_CALL_DELEGATE(lowered_module, *args)
    return outputs


def _outputs_from_metadata(program, args):
    leaves = tree_leaves(args)
    if not leaves or not all(isinstance(a, FakeTensor) for a in leaves):
        return None
    signature = program.graph_signature
    if (signature.buffers_to_mutate or signature.user_inputs_to_mutate
            or program.call_spec.out_spec is None):
        return None
    inputs = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    recorded = [inputs[name].meta.get("val") for name in signature.user_inputs]
    if len(recorded) != len(leaves):
        return None
    sizes = {}  # the program's size symbols -> this call's sizes
    for was, now in zip(recorded, leaves):
        if not isinstance(was, FakeTensor) or was.dtype != now.dtype or was.dim() != now.dim():
            return None
        for a, b in zip(was.shape, now.shape):
            if isinstance(a, torch.SymInt):
                expr = a.node.expr
                if not expr.is_Symbol or str(sizes.setdefault(expr, b)) != str(b):
                    return None
            elif isinstance(b, torch.SymInt) or a != b:
                return None
    output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    made = []
    for node in output.args[0]:
        val = getattr(node, "meta", {}).get("val")
        if not isinstance(val, FakeTensor) or not val.is_contiguous():
            return None
        shape = []
        for d in val.shape:
            if isinstance(d, torch.SymInt):
                if d.node.expr not in sizes:
                    return None
                d = sizes[d.node.expr]
            shape.append(d)
        made.append(leaves[0].new_empty(shape, dtype=val.dtype, device=val.device))
    return tree_unflatten(made, program.call_spec.out_spec)


def _install() -> None:
    for base, fx in _MEMOIZED_FX.items():
        base._fx = fx


def _restore() -> None:
    for base, fx in _UPSTREAM_FX.items():
        base._fx = fx


_DELEGATE = importlib.import_module("torch._higher_order_ops.executorch_call_delegate")
_UPSTREAM_CALL_DELEGATE = _DELEGATE.call_delegate_cpu


_LOWERED = importlib.import_module("executorch.exir.lowered_backend_module")
_UPSTREAM_LEGALIZE = _LOWERED.legalize_graph
# legalize_graph's own list: nodes it moves to the front of its queue
_PRIORITIZED = (operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv,
                operator.mod, operator.le, operator.lt, operator.ge, operator.gt, operator.eq,
                operator.ne, torch.ops.aten.sym_constrain_range.default,
                torch.ops.aten.sym_constrain_range_for_size.default,
                torch.ops.aten._assert_async.msg, torch.ops.aten.scalar_tensor.default,
                torch.ops.aten._assert_scalar.default)


def _legalized_in_place(gm):
    """legalize_graph as `create_submodule_from_nodes` calls it once per partition, over the
    whole program: the same topological order (its Kahn sort, queue and priorities), but the
    graph's own nodes moved into it instead of copied into a new graph, and no recompile
    (nothing runs the graph module's code before ExecuTorch rebuilds it into the lowered
    program). What a copy would also change is made the same: each node's users in the new
    order, its inputs in argument order, and the graph's names as a new graph would hold them
    (so the names later nodes get are the same)."""
    graph = gm.graph
    indeg = dict.fromkeys(graph.nodes, 0)
    for node in graph.nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(node for node in graph.nodes if indeg[node] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in _PRIORITIZED:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(graph.nodes):  # a cycle: upstream's error
        return _UPSTREAM_LEGALIZE(gm)
    namespace = torch.fx.graph._Namespace()
    for node in order:
        if namespace.create_name(node.name, None) != node.name:  # a name a copy would change
            return _UPSTREAM_LEGALIZE(gm)
        namespace.associate_name_with_obj(node.name, node)
    for node in order:
        graph._root.prepend(node)  # to the end: the nodes end in `order`
        node.args = node.args  # re-registers it last among its inputs' users
    graph._graph_namespace = namespace
    return gm


_CHAINED = "executorch.exir.passes."

PATCHES = (
    Patch(name="exir.composite_fake_runs", summary="retraces answer composite ops (torchao's "
          "quantize ops, linear) from the first fake run of the same shapes",
          written_for={"executorch": "1.5."}, pins={
              "executorch.exir.pass_base:_ExportPassBase._fx": "d21aacbb5c107fba",
              "torch._export.pass_base:_ExportPassBaseDeprecatedDoNotUse._fx":
                  "fc5bee485d9e884b"},
          install=_install, restore=_restore,
          installed=lambda: all(base._fx is fx for base, fx in _MEMOIZED_FX.items())),
    Patch(name="exir.kept_op_fake_runs", summary="the decomposition trace answers the "
          "composite ops it keeps (torchao's quantize ops) from the first fake run of the same "
          "shapes", written_for={"executorch": "1.5."}, pins={
              "torch.export.exported_program:_override_composite_implicit_decomp":
                  "4422dc79d0792af7",
              "torch._subclasses.fake_impls:register_op_impl": "405e93300718a185"},
          **replacing(_EXPORTED_PROGRAM, "register_op_impl", _register_remembering)),
    Patch(name="exir.chained_edge_passes", summary="the aten-to-edge passes that rewrite node by "
          "node run as two retraces instead of seven", written_for={"executorch": "1.5."}, pins={
              "executorch.exir.program._program:_generate_edge_program": "231b0ef63ff582cb",
              "executorch.exir.program._program:_get_aten_to_edge_passes": "8661a1a814cd6423",
              _CHAINED + "normalize_transpose_pass:NormalizeTransposePass": "9eda784569a1751e",
              _CHAINED + "replace_broken_ops_with_function_ops_pass:"
              "ReplaceBrokenOpsWithFunctionalOpsPass": "cd77e91fb55d9f48",
              _CHAINED + "scalar_to_tensor_pass:ScalarToTensorPass": "32d6cd941c376504",
              _CHAINED + "sym_to_tensor_pass:SymToTensorPass": "4b4f5a945e263c93",
              _CHAINED + "remove_mixed_type_operators:RemoveMixedTypeOperators":
                  "e6f1507618597d50",
              _CHAINED + "replace_aten_with_edge_pass:OpReplacePass": "a31a8cccd25a9fc6",
              _CHAINED + "memory_format_ops_pass:MemoryFormatOpsPass": "38438c41e1281c84",
              "executorch.exir.pass_base:ExportPass.ExportInterpreter.call_function":
                  "06dd589a22c1dcc6",
              "executorch.exir.pass_base:_ExportPassBase.ExportInterpreter.call_function":
                  "2c3670ac0cadb81e",
              "executorch.exir.pass_base:_ExportPassBase.call_operator": "dcedf9677c29bb60",
              "torch.fx.passes.infra.pass_manager:pass_result_wrapper": "ea1602ce8249ace3"},
          **replacing(_program, "_generate_edge_program", _generate_edge_program)),
    Patch(name="exir.one_decomposition_trace", summary="a program for XNNPACK's partitioner (whose "
          "kept ops come from its configs) is functionalized and decomposed in one trace instead "
          "of two", written_for={"executorch": "1.5."}, pins={
              "executorch.exir.program._program:_gen_edge_manager_for_partitioners":
                  "14a2b38bd338a215",
              "executorch.exir.program._program:_can_skip_using_EDGE_DO_NOT_DECOMP":
                  "1a585e8da9c472e0",
              "torch.export.exported_program:ExportedProgram.run_decompositions":
                  "c74cbc17d3874021"},
          **replacing(_program, "_gen_edge_manager_for_partitioners",
                      _gen_edge_manager_for_partitioners)),
    Patch(name="exir.legalize_in_place", summary="partitioning reorders the program's own "
          "nodes after each partition instead of copying the whole graph and recompiling it",
          written_for={"executorch": "1.5."}, pins={
              "torch.fx.passes.tools_common:legalize_graph": "6dc8094b32ebd463",
              "executorch.exir.lowered_backend_module:create_submodule_from_nodes":
                  "3279f5ec23b0b723",
              "executorch.exir.backend.backend_api:_create_partitions_in_graph_module":
                  "2c8bd8d290ecfb2d",
              "torch.fx.graph:Graph.node_copy": "1ea7e7358568c428",
              "torch.fx.graph:Graph.create_node": "7e8353cfe5d2ae96"},
          **replacing(_LOWERED, "legalize_graph", _legalized_in_place)),
    Patch(name="exir.delegate_fake_outputs", summary="a retrace past the delegates makes "
          "their outputs from the delegate programs' metadata instead of running each program "
          "on fake tensors", written_for={"executorch": "1.5."}, pins={
              "torch._higher_order_ops.executorch_call_delegate:call_delegate_cpu":
                  "4e7ab5016a0073bc",
              "torch._higher_order_ops.executorch_call_delegate:call_delegate_fake_tensor_mode":
                  "d692c8ae03197911",
              "torch._higher_order_ops.executorch_call_delegate:trace_call_delegate":
                  "7955488b30b5f674"},
          **replacing(_DELEGATE, "call_delegate_cpu", _delegate_outputs)),
)
