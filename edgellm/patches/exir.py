"""Retraces without re-running torchao's quantize ops on fake tensors: a patch of ExecuTorch
1.5's ExportPass and of torch.export's older pass base.

Every ExportPass retraces its graph: each node's op runs again on fake tensors to give the new
node its metadata. torchao's quantize primitives (`choose_qparams_affine`, `quantize_affine`,
`dequantize_affine`) are CompositeImplicitAutograd ops, so each of those runs is their Python
body, twenty-odd ATen ops. An 8da4w program holds four per linear, and lowering retraces it some
twenty times (aten-to-edge passes, XNNPACK's passes, `to_executorch`).

A fake run of such an op has no data: its outputs' shapes, strides and dtypes follow from its
inputs' and its other arguments, which is what ExecuTorch keeps from the run. `_Remembering`
keeps them per fake mode (the symbolic sizes belong to its ShapeEnv) and answers a repeat with
new empty fake tensors of the same metadata. Only functional torchao ops, only when every tensor
argument is a fake tensor of one mode; anything else runs as before. The .pte is the same.

`exir.torchao_fake_runs` wraps `_fx` of ExecuTorch's ExportPass and of torch.export's older pass
base (which some of ExecuTorch's aten-to-edge passes still use).
"""

from __future__ import annotations

import functools
import weakref

import torch
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from executorch.exir.pass_base import _ExportPassBase
from torch._export.pass_base import _ExportPassBaseDeprecatedDoNotUse
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from . import Patch

# ExecuTorch's ExportPass and torch.export's older one (ReplaceViewOpsWithViewCopyOpsPass)
# build each node the same way: `_fx` runs the op through `self.interpreter`, then adds the node
_PASS_BASES = (_ExportPassBase, _ExportPassBaseDeprecatedDoNotUse)
_UPSTREAM_FX = {base: base.__dict__["_fx"] for base in _PASS_BASES}
# fake mode -> {(op, arguments' metadata): outputs' metadata}; an entry goes with its mode
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def memoizable(op) -> bool:
    """A functional torchao op that runs as its Python decomposition, as an ATen-dialect target
    or wrapped as an edge op."""
    if isinstance(op, EdgeOpOverload):
        op = op._op
    return (isinstance(op, torch._ops.OpOverload) and op.namespace == "torchao"
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


class _Remembering:
    """Stands in for ExportPass's interpreter for one call_function."""

    def __init__(self, interpreter, seen: dict):
        self.interpreter, self.seen = interpreter, seen

    def call_function(self, target, args, kwargs):
        key = (target, metadata(args), metadata(kwargs))
        seen = self.seen.get(key)
        if seen is not None:  # new fake tensors, in the mode the pass is running under
            several, specs = seen
            return tuple(map(_like, specs)) if several else _like(specs[0])
        result = self.interpreter.call_function(target, args, kwargs)
        several = isinstance(result, tuple)
        results = result if several else (result,)
        if all(isinstance(r, FakeTensor) for r in results):
            self.seen[key] = (several, tuple((r.shape, r.stride(), r.dtype, r.device,
                                              r.requires_grad) for r in results))
        return result


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


def _install() -> None:
    for base, fx in _MEMOIZED_FX.items():
        base._fx = fx


def _restore() -> None:
    for base, fx in _UPSTREAM_FX.items():
        base._fx = fx


PATCHES = (
    Patch(name="exir.torchao_fake_runs", summary="retraces answer torchao's quantize ops from "
          "the first fake run of the same shapes", written_for={"executorch": "1.5."}, pins={
              "executorch.exir.pass_base:_ExportPassBase._fx": "d21aacbb5c107fba",
              "torch._export.pass_base:_ExportPassBaseDeprecatedDoNotUse._fx":
                  "fc5bee485d9e884b"},
          install=_install, restore=_restore,
          installed=lambda: all(base._fx is fx for base, fx in _MEMOIZED_FX.items())),
)
