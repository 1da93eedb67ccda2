"""Core ML lowering in ExecuTorch 1.5 with coremltools 9: patches that keep it from copying the
weights, piling up temporaries and re-checking what nothing changed, and that make op names
repeatable.

- `coreml.shared_weights`: `BackendDetails.copy_exported_program_for_preprocess` deep-copies
  the partition's program, weights included, although `CoreMLBackend.preprocess` only reads
  them (coremltools turns each weight into a numpy view and makes new arrays for what it
  changes); and `CoreMLBackend.preprocess_model` reads the saved mlpackage into `bytes` while the
  converted model still holds its MIL program, whose fp16 constants are the weights once more.
  The patch shares the weights with the copy (through the hook ExecuTorch gives backends) and
  lets the converted model drop its MIL program once it is saved (that save uses it for the
  debug-handle mapping; nothing after it does).
- `coreml.fp16_checks`: `FP16ComputePrecision.fp16_overflow` takes, for every fp32 constant
  input of every op, `np.abs` of the whole constant and `np.where` of it (int64 indices, three
  per element of its rank-3 view), and `_check_underflow_to_zero` flattens a copy of each
  constant to count it. The patch answers the same a million elements at a time and counts in
  place.
- `coreml.validate_once`: coremltools validates the MIL program before each pass pipeline and
  after each of its passes, a structural check that a pass that runs correctly leaves true; the
  patch validates each pipeline's result once, with the check its last pass would have had.
- `coreml.exact_dedup`: the const_deduplication pass compares constants whose first values hash
  alike with `np.allclose`, which turns integer arrays into float64 and makes several
  temporaries of that size: a tied 8-bit table and its head (49152 x 576 on SmolLM2) took about
  1.5 GB for one comparison, the whole Core ML export's peak. Its tolerance for integer types is
  1e-12, an exact comparison: the patch compares integer arrays with `np.array_equal` (one
  boolean temporary), other arrays as upstream does.
- `coreml.fresh_op_names`: coremltools numbers MIL ops by a class-level counter that it clears
  after each conversion, not before, so a MIL program built earlier in the process renames every
  op of the next conversion (and the payload's content-derived identifier with them). The patch
  clears it when partitioners are made.

The .pte is the same with and without them (tested in one process).
"""

from __future__ import annotations

import copy
import importlib

import numpy as np
import torch
from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
from coremltools.converters.mil.converter import _reset_conversion_state
from executorch.backends.apple.coreml.compiler import CoreMLBackend

from ..memory import release_memory
from . import Patch

_COPY_HOOK = "copy_exported_program_for_preprocess"
_UPSTREAM_OVERFLOW = FP16ComputePrecision.__dict__["fp16_overflow"]
_UPSTREAM_UNDERFLOW = FP16ComputePrecision.__dict__["_check_underflow_to_zero"]
_UPSTREAM_PREPROCESS_MODEL = CoreMLBackend.__dict__["preprocess_model"]  # a staticmethod
_UPSTREAM_APPLY_PIPELINE = PassPipelineManager.__dict__["apply_pipeline"]  # a staticmethod
_DEDUP = importlib.import_module(
    "coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication")
_CHUNK = 1 << 20  # elements checked at a time
_FP16_MAX = 65504


def _copy_sharing_weights(cls, edge_program, compile_specs):
    """The graph copied, as ExecuTorch's hook does, with every tensor weight shared: a deepcopy
    whose memo already maps each one to itself. Views are shared too: coremltools reads them
    through numpy, strides and all, and never writes them."""
    memo = {id(t): t for t in [*edge_program.state_dict.values(), *edge_program.constants.values()]
            if isinstance(t, torch.Tensor)}
    return copy.deepcopy(edge_program, memo)


def exceeds_fp16(values) -> bool:
    """coremltools' test, chunked: is any |value| below 1e38 (so not +-inf, not NaN) above fp16's
    largest, 65504? Values at 1e38 and beyond may become fp16's inf; NaN is ignored."""
    flat = np.asarray(values).reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        part = np.abs(flat[start:start + _CHUNK])
        if np.max(part, where=part < 1e38, initial=0.0) > _FP16_MAX:
            return True
    return False


def _fp16_overflow(self, op) -> bool:
    """FP16ComputePrecision.fp16_overflow of coremltools 9.0 with its check done by
    `exceeds_fp16`: does any fp32 constant input of `op` hold a finite value fp16 cannot?"""
    for inputs in op.inputs.values():
        for var in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
            if (var.op is not None and var.op.op_type == "const"
                    and var.is_tensor_or_scalar_of(dtype="fp32")
                    and exceeds_fp16(var.op.val.val)):
                return True
    return False


def _preprocess_model(mlmodel, model_type):
    """ExecuTorch's preprocess_model, with this model's MIL program dropped right after it is
    saved (an attribute of this one model object, which only ExecuTorch's preprocess holds)."""
    upstream_save = mlmodel.save

    def save_then_forget(path):
        upstream_save(path)
        mlmodel._mil_program = None
        release_memory()  # the MIL program (it holds cycles) and the checkpoint pages conversion
        # read, before the payload is read

    mlmodel.save = save_then_forget
    return _UPSTREAM_PREPROCESS_MODEL.__func__(mlmodel, model_type)


def _check_underflow_to_zero(self, new_var, var) -> None:
    """coremltools 9.0's, which looks only at constants under 400 elements but counts them by
    flattening a copy of each: counted in place."""
    if new_var.val is not None and np.size(var.val) >= 400:
        return
    _UPSTREAM_UNDERFLOW(self, new_var, var)


def _apply_pipeline(prog, pass_pipeline) -> None:
    """PassPipelineManager.apply_pipeline validating the program once, after the pipeline, as its
    last pass would have, instead of before the pipeline and after each pass: the validation is a
    structural check (every var's consumers agree with every op's inputs) that changes nothing.
    A pass that leaves the program inconsistent still fails the conversion, at the end of its
    pipeline rather than right after it (EDGELLM_NO_PATCHES=coreml.validate_once checks after
    every pass again)."""
    last = {}
    prog.validate = lambda check_essential_scope=False: last.update(scope=check_essential_scope)
    try:
        _UPSTREAM_APPLY_PIPELINE.__func__(prog, pass_pipeline)
    finally:
        del prog.validate  # the instance attribute shadowed Program.validate
    prog.validate(check_essential_scope=last.get("scope", False))


class _ExactNumpy:
    """numpy as the const_deduplication pass sees it: `allclose` of two integer (or boolean)
    arrays is `array_equal`, which the pass's tolerance of 1e-12 makes it, without float64
    copies; everything else is numpy's."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def allclose(a, b, *args, **kwargs) -> bool:
        if np.asarray(a).dtype.kind in "biu" and np.asarray(b).dtype.kind in "biu":
            return np.array_equal(a, b)
        return np.allclose(a, b, *args, **kwargs)


EXACT_NUMPY = _ExactNumpy()


def _install_shared_weights() -> None:
    setattr(CoreMLBackend, _COPY_HOOK, classmethod(_copy_sharing_weights))
    CoreMLBackend.preprocess_model = staticmethod(_preprocess_model)


def _restore_shared_weights() -> None:
    if _COPY_HOOK in CoreMLBackend.__dict__:
        delattr(CoreMLBackend, _COPY_HOOK)
    CoreMLBackend.preprocess_model = _UPSTREAM_PREPROCESS_MODEL


def _install_fp16_checks() -> None:
    FP16ComputePrecision.fp16_overflow = _fp16_overflow
    FP16ComputePrecision._check_underflow_to_zero = _check_underflow_to_zero


def _restore_fp16_checks() -> None:
    FP16ComputePrecision.fp16_overflow = _UPSTREAM_OVERFLOW
    FP16ComputePrecision._check_underflow_to_zero = _UPSTREAM_UNDERFLOW


def _patch(name, summary, pins, install, restore, installed) -> Patch:
    return Patch(name=f"coreml.{name}", summary=summary,
                 written_for={"executorch": "1.5.", "coremltools": "9."}, pins=pins,
                 install=install, restore=restore, installed=installed)


CONVERTER = "coremltools.converters.mil.converter"
PASSES = "coremltools.converters.mil.mil.passes"
PATCHES = (
    _patch("shared_weights", "Core ML's preprocess shares the weights instead of copying them, "
           "and the converted model drops its MIL program once saved", {
               "executorch.exir.backend.backend_details:BackendDetails."
               "copy_exported_program_for_preprocess": "161d76674b18cbbd",
               "executorch.backends.apple.coreml.compiler.coreml_preprocess:CoreMLBackend."
               "preprocess_model": "76e2d63d21d58926"},
           _install_shared_weights, _restore_shared_weights,
           lambda: CoreMLBackend.__dict__["preprocess_model"].__func__ is _preprocess_model),
    _patch("fp16_checks", "coremltools' fp16 range checks run in chunks and in place", {
               f"{PASSES}.defs.quantization:FP16ComputePrecision.fp16_overflow":
                   "16442a50be56e0f9",
               f"{PASSES}.defs.quantization:FP16ComputePrecision._check_underflow_to_zero":
                   "ca65abdf8aafa58d"},
           _install_fp16_checks, _restore_fp16_checks,
           lambda: FP16ComputePrecision.__dict__["fp16_overflow"] is _fp16_overflow),
    _patch("validate_once", "coremltools validates each MIL pass pipeline's result once", {
               f"{PASSES}.pass_pipeline:PassPipelineManager.apply_pipeline": "7bae57bb03db4bf4"},
           lambda: setattr(PassPipelineManager, "apply_pipeline", staticmethod(_apply_pipeline)),
           lambda: setattr(PassPipelineManager, "apply_pipeline", _UPSTREAM_APPLY_PIPELINE),
           lambda: PassPipelineManager.__dict__["apply_pipeline"].__func__ is _apply_pipeline),
    _patch("exact_dedup", "coremltools' constant deduplication compares integer constants "
           "exactly, without float64 copies", {
               f"{PASSES}.defs.cleanup.const_deduplication:const_deduplication.find_constants":
                   "103228f30c480990"},
           lambda: setattr(_DEDUP, "np", EXACT_NUMPY), lambda: setattr(_DEDUP, "np", np),
           lambda: _DEDUP.np is EXACT_NUMPY),
    # not a replacement: each install clears the counter, so it reports itself not installed
    _patch("fresh_op_names", "MIL op names count from zero in each export's conversion", {
               f"{CONVERTER}:_reset_conversion_state": "416a01148cd847fa",
               f"{CONVERTER}:_mil_convert": "3257110e24a429bf"},
           lambda: _reset_conversion_state(), lambda: None, lambda: False),
)
