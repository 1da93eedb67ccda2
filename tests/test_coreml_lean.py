"""Core ML lowering without a copy of the weights (backends/coreml_lean.py): the same model.pte as
ExecuTorch's and coremltools' own lowering, and an fp16 range check that answers as coremltools'
does."""

import numpy as np
import pytest
import torch

import edgellm
from edgellm.backends import UPSTREAM_COPIES, coreml

SIZES = dict(max_seq_len=16, max_context_len=32)


@pytest.fixture
def lean():
    """The workaround module; skips where the guard leaves ExecuTorch and coremltools alone."""
    import coremltools
    from executorch.version import __version__

    if not (__version__.startswith("1.5.") and coremltools.__version__.startswith("9.")):
        pytest.skip("the workarounds apply to ExecuTorch 1.5 with coremltools 9 only")
    from edgellm.backends import coreml_lean

    return coreml_lean


@pytest.mark.parametrize("arch, options", [("lfm2", {}), ("llama", {"prefill_chunk": 4}),
                                           ("llama", {"quantize": "4w"})])
def test_lean_core_ml_lowering_gives_the_upstream_bytes(tiny_models, tmp_path, monkeypatch, lean,
                                                        arch, options):
    """One process (coremltools' protobuf maps are written in a per-process order), upstream
    first, then edgellm's; each run's delegate lint opened the payload."""
    folder, _ = tiny_models[arch]
    calls = []
    monkeypatch.setattr(lean, "exceeds_fp16", lambda v, _up=lean.exceeds_fp16: calls.append(1)
                        or _up(v))
    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    edgellm.export(folder, output=tmp_path / "upstream", backends="coreml", verify=False,
                   quiet=True, **SIZES, **options)
    assert not lean.installed() and calls == []
    monkeypatch.delenv(UPSTREAM_COPIES)
    edgellm.export(folder, output=tmp_path / "lean", backends="coreml", verify=False,
                   quiet=True, **SIZES, **options)
    assert lean.installed() and calls  # coremltools asked edgellm's check
    upstream, ours = ((tmp_path / n / "model.pte").read_bytes() for n in ("upstream", "lean"))
    assert len(ours) > 10_000 and ours == upstream


@pytest.mark.parametrize("values", [
    np.float32(3.0), np.float32(70000.0), np.array([1e38, -np.inf, np.nan, 2.0], np.float32),
    np.array([[1.0, -65504.0], [0.5, 65504.0]], np.float32),
    np.array([[1.0, -65505.0]], np.float32), np.array([np.inf, 1e39], np.float32),
    np.concatenate([np.zeros(3 << 20, np.float32), [7e4]]),  # past the first chunks
    np.zeros((0, 4), np.float32)])
def test_fp16_range_check_answers_as_coremltools_does(lean, values):
    value = np.expand_dims(values, 0)  # coremltools 9.0's own test, verbatim
    abs_value = np.abs(value)
    upstream = np.max(abs_value[np.where(abs_value < 1e38)], initial=0.0) > 65504
    assert lean.exceeds_fp16(values) == upstream


def test_the_copy_shares_every_weight_views_included(lean):
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.whole = torch.nn.Parameter(torch.randn(4, 4))
            self.view = torch.nn.Parameter(torch.randn(12, 4).chunk(3)[1])

        def forward(self, x):
            return x @ self.whole + x @ self.view

    ep = torch.export.export(Two(), (torch.randn(2, 4),))
    lean.install()
    twin = CoreMLBackend.copy_exported_program_for_preprocess(ep, [])
    assert all(twin.state_dict[k] is ep.state_dict[k] for k in ("whole", "view"))
    assert twin.graph_module is not ep.graph_module


def test_partitioners_install_the_workarounds_for_these_versions_only(lean, monkeypatch):
    import executorch.version

    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    coreml._partitioners(coreml.CoreMLOptions())
    assert not lean.installed()
    monkeypatch.delenv(UPSTREAM_COPIES)
    coreml._partitioners(coreml.CoreMLOptions())
    assert lean.installed()
    monkeypatch.setenv(UPSTREAM_COPIES, "1")
    coreml._partitioners(coreml.CoreMLOptions())
    monkeypatch.delenv(UPSTREAM_COPIES)
    monkeypatch.setattr(executorch.version, "__version__", "1.6.0")
    coreml._partitioners(coreml.CoreMLOptions())
    assert not lean.installed()


def test_mil_pipelines_validate_once_and_still_catch_a_broken_pass(lean, monkeypatch):
    """coremltools validates before a pipeline and after each pass; the lean pipeline once, after
    its last pass, with that pass's check. A pass that breaks the program still fails."""
    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import Program, types
    from coremltools.converters.mil.mil.block import InvalidBlockStateError
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_pipeline import (PassPipeline,
                                                                       PassPipelineManager)
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp32)])
    def prog(x):
        return mb.relu(x=mb.add(x=x, y=1.0))

    checks = []
    real = Program.validate
    monkeypatch.setattr(Program, "validate",
                        lambda self, check_essential_scope=False: checks.append(
                            check_essential_scope) or real(self, check_essential_scope))
    pipeline = PassPipeline.DEFAULT
    lean.install()
    PassPipelineManager.apply_pipeline(prog, pipeline)
    assert pipeline.passes[-1] == "common::dead_code_elimination" and checks == [True]
    lean.restore()
    PassPipelineManager.apply_pipeline(prog, pipeline)
    assert len(checks) == 2 + len(pipeline.passes)

    class BreakIt(AbstractGraphPass):  # relu's input forgets that relu consumes it
        def apply(self, program):
            relu = program.functions["main"].find_ops(op_type="relu")[0]
            relu.x._child_ops.remove(relu)

    monkeypatch.setitem(PASS_REGISTRY.passes, "test::break_it", BreakIt)
    broken = PassPipeline(pass_names=["test::break_it", "common::const_elimination"])
    lean.install()
    with pytest.raises(InvalidBlockStateError, match="should be consumed by op"):
        PassPipelineManager.apply_pipeline(prog, broken)
