"""The same inputs and options give a byte-identical model.pte: XNNPACK float and quantized, and
Core ML, whose payload identifiers and mlpackage manifest keys edgellm derives from the content
(ExecuTorch and coremltools draw fresh uuid4s)."""

import re

import pytest

import edgellm


@pytest.mark.parametrize("options", [{}, {"quantize": "8da4w", "group_size": 32,
                                          "embedding_quantize": "4,32"}])
def test_exporting_twice_gives_the_same_bytes(tiny_models, tmp_path, options):
    paths = []
    for name in ("a", "b"):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / name, backends="xnnpack",
                       max_seq_len=16, verify=False, quiet=True, **options)
        paths.append(tmp_path / name / "model.pte")
    first, second = (p.read_bytes() for p in paths)
    assert len(first) > 10_000 and first == second


def identifiers(pte):
    return re.findall(rb"executorch_([0-9a-f-]{36})", pte.read_bytes())


def test_core_ml_programs_are_repeatable_and_named_by_their_content(tiny_models, tmp_path):
    reports = {}
    for name, seq in (("a", 16), ("b", 16), ("c", 8)):
        reports[name] = edgellm.export(tiny_models["llama"][0], output=tmp_path / name,
                                       backends="coreml", max_seq_len=seq, verify=False,
                                       quiet=True, prefill_chunk=4)
    a, b, c = (tmp_path / n / "model.pte" for n in "abc")
    assert a.read_bytes() == b.read_bytes()
    assert identifiers(a) and set(identifiers(a)).isdisjoint(identifiers(c))
    # the payloads still open: the export's own lint read every one (both methods, one
    # multifunction package whose named-data key carries the identifier)
    assert [d["method"] for d in reports["a"]["delegates"]["coreml"]] == ["forward", "prefill"]


@pytest.mark.parametrize("arch, extra", [("lfm2", []), ("llama", ["--prefill-chunk", "4"])])
def test_core_ml_programs_are_the_same_from_two_processes(tiny_models, tmp_path, arch, extra):
    """coremltools writes the spec's protobuf maps in an order that changes between processes
    (not between exports in one): edgellm rewrites each spec in canonical order."""
    import subprocess
    import sys

    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "edgellm.cli", "export", str(tiny_models[arch][0]),
                        "-o", str(tmp_path / name), "--backend", "coreml", "--max-seq-len", "16",
                        "--no-verify", "--quiet", *extra], check=True, capture_output=True)
    first, second = ((tmp_path / n / "model.pte").read_bytes() for n in "ab")
    assert len(first) > 10_000 and first == second


def test_core_ml_programs_do_not_depend_on_mil_built_before(tiny_models, tmp_path):
    """coremltools numbers MIL ops by a counter it clears after a conversion, not before: a MIL
    program built earlier in the process must not rename the ops of the next export."""
    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    options = dict(backends="coreml", max_seq_len=8, verify=False, quiet=True)
    edgellm.export(tiny_models["llama"][0], output=tmp_path / "a", **options)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp32)])
    def elsewhere(x):
        return mb.relu(x=mb.add(x=x, y=1.0))

    edgellm.export(tiny_models["llama"][0], output=tmp_path / "b", **options)
    assert (tmp_path / "a" / "model.pte").read_bytes() == (tmp_path / "b" / "model.pte").read_bytes()
