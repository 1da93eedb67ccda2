"""The same inputs and options give a byte-identical model.pte. XNNPACK's is checked where an export
is made again (fp32: test_pipeline.py's replay; quantized: test_patches.py); here Core ML's,
whose payload identifiers and mlpackage manifest keys edgellm derives from the content
(ExecuTorch and coremltools draw fresh uuid4s) and whose specs it rewrites in a canonical order."""

import re

import edgellm


def identifiers(pte):
    return re.findall(rb"executorch_([0-9a-f-]{36})", pte.read_bytes())


def test_core_ml_programs_are_repeatable_and_named_by_their_content(exported, tiny_models,
                                                                     tmp_path):
    folder, report = exported("llama", backends="coreml", prefill_chunk=4, verify=False,
                              etrecord=False)
    edgellm.export(tiny_models["llama"][0], output=tmp_path / "b", backends="coreml",
                   max_seq_len=16, max_context_len=32, verify=False, quiet=True, prefill_chunk=4)
    a, b = folder / "model.pte", tmp_path / "b" / "model.pte"
    c = exported("llama", backends="coreml")[0] / "model.pte"  # one method: other content
    assert a.read_bytes() == b.read_bytes()
    assert identifiers(a) and set(identifiers(a)).isdisjoint(identifiers(c))
    # the payloads still open: the export's own lint read every one (both methods, one
    # multifunction package whose named-data key carries the identifier)
    assert [d["method"] for d in report["delegates"]["coreml"]] == ["forward", "prefill"]


def test_core_ml_programs_are_the_same_from_two_processes(exported, tiny_models, tmp_path):
    """coremltools writes the spec's protobuf maps in an order that changes between processes
    (not between exports in one): edgellm rewrites each spec in canonical order. This process's
    export (two methods in one multifunction payload) against a new process's."""
    import subprocess
    import sys

    folder, _ = exported("llama", backends="coreml", prefill_chunk=4, verify=False,
                         etrecord=False)
    subprocess.run([sys.executable, "-m", "edgellm.cli", "export", str(tiny_models["llama"][0]),
                    "-o", str(tmp_path / "b"), "--backend", "coreml", "--max-seq-len", "16",
                    "--max-context-len", "32", "--prefill-chunk", "4", "--no-verify", "--quiet"],
                   check=True, capture_output=True)
    first, second = ((f / "model.pte").read_bytes() for f in (folder, tmp_path / "b"))
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
    first, second = ((tmp_path / n / "model.pte").read_bytes() for n in "ab")
    assert first == second
