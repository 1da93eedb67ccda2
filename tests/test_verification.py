"""verify: the program against the checkpoint, passing on correct programs and failing with exit
code 1 and a readable report on a program built from perturbed weights."""

import json
import shutil

import pytest
import yaml

import edgellm
from edgellm.cli import main


@pytest.mark.parametrize("arch", ["lfm2", "llama", "qwen2", "qwen3"])
def test_export_verifies_its_program(tiny_models, tmp_path, arch, capsys):
    folder = tiny_models[arch][0]
    report = edgellm.export(folder, output=tmp_path / "x", backends="xnnpack", max_seq_len=16,
                            max_context_len=32, quiet=True)
    result = report["verify"]
    assert result["passed"] and [c["level"] for c in result["checks"]] == ["rewrite", "program"]
    for check in result["checks"]:
        assert check["sqnr_db"] > 100 and check["top1"] == 1.0, check  # fp32: exact but rounding
        assert check["first_divergence"] is None
    assert result["prompts"] == [5, 11] and result["steps"] == 8
    assert "verify" in [s["name"] for s in report["stages"]]
    assert main(["verify", str(tmp_path / "x" / "model.pte")]) == 0
    out = capsys.readouterr().out
    assert "rewrite: ok" in out and "program: ok" in out


def test_a_program_from_perturbed_weights_fails_with_exit_code_1(tiny_models, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = tiny_models["lfm2"][0]
    shutil.copytree(folder, tmp_path / "perturbed")
    weights = load_file(tmp_path / "perturbed" / "model.safetensors")
    w = weights["model.layers.1.self_attn.v_proj.weight"]
    weights["model.layers.1.self_attn.v_proj.weight"] = w + 0.5 * w.std()
    save_file(weights, tmp_path / "perturbed" / "model.safetensors", metadata={"format": "pt"})
    edgellm.export(tmp_path / "perturbed", output=tmp_path / "x", backends="xnnpack",
                   max_seq_len=16, verify=False, quiet=True)
    config = yaml.safe_load((tmp_path / "x" / "config.yaml").read_text())
    config["model"] = str(folder)  # the checkpoint the program claims to come from
    (tmp_path / "x" / "config.yaml").write_text(yaml.safe_dump(config))

    assert main(["verify", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "failed verification (program)" in err and "program: FAILED" in err
    assert "rewrite: ok" in err  # the eager model is still right: the program is what differs
    assert main(["verify", str(tmp_path / "x"), "--json"]) == 1
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    program = result["checks"][1]
    assert not result["passed"] and program["sqnr_db"] < program["min_sqnr_db"]


def test_core_ml_is_checked_as_far_as_this_machine_can(tiny_models, tmp_path):
    report = edgellm.export(tiny_models["lfm2"][0], output=tmp_path / "c", backends="coreml",
                            max_seq_len=16, quiet=True)
    rewrite, graph = report["verify"]["checks"]
    assert rewrite["level"] == "rewrite" and rewrite["passed"]
    assert graph["level"] == "exported graph" and graph["passed"]
    assert "the coreml delegate was not executed" in graph["note"]


def test_verify_refuses_a_folder_without_an_export(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "No config.yaml in" in capsys.readouterr().err


def test_a_quantized_program_passes_as_kernel_rounding_only_when_as_close_to_fp32():
    """XNNPACK's activation rounding differs from torchao's: a program whose error against fp32
    is independent of, and as large as, its eager model's misses the program bound against that
    model but passes; a program far from fp32 fails, and the note says which rule applied."""
    import torch

    from edgellm.verification import THRESHOLDS, kernel_rounding, measure

    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(8, 50, generator=g) * 4 + torch.eye(8, 50) * 16]  # clear greedy tokens
    eager = [ref[0] + torch.randn(8, 50, generator=g) * 0.4]  # 20 dB from fp32
    rounding = [ref[0] + torch.randn(8, 50, generator=g) * 0.4]  # as far, elsewhere
    broken = [ref[0] + torch.randn(8, 50, generator=g) * 2.0]
    for actual, passes in ((rounding, True), (broken, False)):
        check = measure("program", actual, eager, THRESHOLDS["quantized"])
        assert not check.passed and check.sqnr_db < 20  # 17 dB apart: the plain rule fails
        judged = kernel_rounding(check, actual, eager, ref)
        assert judged.passed is passes and judged.sqnr_db == check.sqnr_db
        assert judged.note.startswith("passed as kernel rounding: against fp32 the program "
                                      if passes else "not explained by kernel rounding: ")


@pytest.mark.parametrize("arch, backend, options", [
    ("llama", "xnnpack", {}),
    ("llama", "xnnpack", {"quantize": "8da4w", "group_size": 32}),
    ("lfm2", "coreml", {}),
    ("lfm2", "coreml", {"quantize": "4w"})])
def test_an_export_verifies_as_verify_does_with_one_quantization_and_the_same_program(
        tiny_models, tmp_path, monkeypatch, arch, backend, options):
    """The export checks the eager model it built and quantized (verification.Verification)
    instead of building and quantizing a second one: the same figures as `edgellm verify` on the
    folder afterwards, and the same program as an export without verification (the checks run
    the model before it is exported and put its caches back)."""
    from edgellm import quantize

    quantized = []
    monkeypatch.setattr(quantize, "quantize", lambda *a, _q=quantize.quantize, **k:
                        quantized.append(1) or _q(*a, **k))
    sizes = dict(max_seq_len=16, max_context_len=32, backends=backend, quiet=True, **options)
    report = edgellm.export(tiny_models[arch][0], output=tmp_path / "v", **sizes)
    assert len(quantized) == (1 if options else 0)
    again = edgellm.verify(tmp_path / "v")
    assert len(quantized) == (2 if options else 0)  # verify alone builds its own
    assert report["verify"] == again
    assert report["verify"]["passed"]
    edgellm.export(tiny_models[arch][0], output=tmp_path / "n", verify=False, **sizes)
    assert (tmp_path / "v" / "model.pte").read_bytes() == (tmp_path / "n" / "model.pte").read_bytes()
