"""Core ML lowering without a copy of the weights and without coremltools' pile of temporaries:
workarounds for ExecuTorch 1.5.x with coremltools 9.x.

Measured on LFM2.5-350M fp32 (1.35 GB of weights, iOS 18, fp16 compute; docs/design.md):
- `BackendDetails.copy_exported_program_for_preprocess` deep-copies the partition's program,
  weights included (+2.0 GB), although `CoreMLBackend.preprocess` only reads them: coremltools
  turns each weight into a numpy view (`tensor.detach().cpu().numpy()`) and makes new arrays for
  what it changes.
- coremltools' `FP16ComputePrecision.fp16_overflow` takes, for every fp32 constant input of every
  op, `np.abs` of the whole constant and `np.where` of it (int64 indices, three per element of its
  rank-3 view): about 128 MB of temporaries per 4 M-element weight. In the conversion they pile up
  to 2 GB before RSS falls back (twice per export), and the check takes 13 of lower's 25 s.
- `CoreMLBackend.preprocess_model` reads the saved mlpackage into `bytes` (0.7 GB) while the
  converted model still holds its MIL program, whose fp16 constants are the weights once more
  (0.7 GB), although they are in the package's weight.bin by then.
- coremltools validates the MIL program before each pass pipeline and after each of its passes
  (118 structural checks, 1.3 s), although a pass that runs correctly changes nothing they check.

`install()` shares the weights with the copy (through the hook ExecuTorch gives backends),
swaps in an `fp16_overflow` that gives the same answer a million elements at a time and an
underflow check that counts a constant's elements without copying it, lets the converted model
drop its MIL program once it is saved (that save uses it for the debug-handle mapping; nothing
after it does), and validates each pipeline's result once. `restore()` puts ExecuTorch's and
coremltools' own back. The .pte is the same either way (tested). Imported only by
`switch_workarounds` for `coreml._lean_lowering`, after its version check.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
from executorch.backends.apple.coreml.compiler import CoreMLBackend

from ..progress import release_memory

_COPY_HOOK = "copy_exported_program_for_preprocess"
_UPSTREAM_OVERFLOW = FP16ComputePrecision.__dict__["fp16_overflow"]
_UPSTREAM_UNDERFLOW = FP16ComputePrecision.__dict__["_check_underflow_to_zero"]
_UPSTREAM_PREPROCESS_MODEL = CoreMLBackend.__dict__["preprocess_model"]  # a staticmethod
_UPSTREAM_APPLY_PIPELINE = PassPipelineManager.__dict__["apply_pipeline"]  # a staticmethod
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
    flattening a copy of each (1.3 s of copies for LFM2.5-350M's weights): counted in place."""
    if new_var.val is not None and np.size(var.val) >= 400:
        return
    _UPSTREAM_UNDERFLOW(self, new_var, var)


def _apply_pipeline(prog, pass_pipeline) -> None:
    """PassPipelineManager.apply_pipeline validating the program once, after the pipeline, as its
    last pass would have, instead of before the pipeline and after each pass: the validation is a
    structural check (every var's consumers agree with every op's inputs) that changes nothing,
    and 118 of them took 1.3 s of an LFM2.5-350M conversion. A pass that leaves the program
    inconsistent still fails the conversion, at the end of its pipeline rather than right after
    it (EDGELLM_UPSTREAM_COPIES=1 checks after every pass again)."""
    last = {}
    prog.validate = lambda check_essential_scope=False: last.update(scope=check_essential_scope)
    try:
        _UPSTREAM_APPLY_PIPELINE.__func__(prog, pass_pipeline)
    finally:
        del prog.validate  # the instance attribute shadowed Program.validate
    prog.validate(check_essential_scope=last.get("scope", False))


def install() -> None:
    setattr(CoreMLBackend, _COPY_HOOK, classmethod(_copy_sharing_weights))
    FP16ComputePrecision.fp16_overflow = _fp16_overflow
    FP16ComputePrecision._check_underflow_to_zero = _check_underflow_to_zero
    CoreMLBackend.preprocess_model = staticmethod(_preprocess_model)
    PassPipelineManager.apply_pipeline = staticmethod(_apply_pipeline)


def restore() -> None:
    if _COPY_HOOK in CoreMLBackend.__dict__:
        delattr(CoreMLBackend, _COPY_HOOK)
    FP16ComputePrecision.fp16_overflow = _UPSTREAM_OVERFLOW
    FP16ComputePrecision._check_underflow_to_zero = _UPSTREAM_UNDERFLOW
    CoreMLBackend.preprocess_model = _UPSTREAM_PREPROCESS_MODEL
    PassPipelineManager.apply_pipeline = _UPSTREAM_APPLY_PIPELINE


def installed() -> bool:
    return FP16ComputePrecision.__dict__["fp16_overflow"] is _fp16_overflow
