"""The command line: thin over the API, one-line errors and exit codes."""

import subprocess
import sys

import pytest

from edgellm.cli import build_parser, main


def test_models_lists_architectures_and_backends(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("lfm2", "llama", "qwen2", "qwen3", "xnnpack", "coreml", "vulkan", "portable"):
        assert name in out
    assert "  8da4w      xnnpack\n" in out and "  4w         coreml\n" in out


def test_a_reader_that_leaves_early_is_no_error():
    """`edgellm models | head -1`: the pipe closes after one line; no internal error on stderr."""
    run = subprocess.run(f"{sys.executable} -m edgellm.cli models | head -1", shell=True,
                         capture_output=True, text=True, check=True)
    assert run.stdout.startswith("architectures") and run.stderr == ""


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code = main(["export", str(tmp_path / "nowhere"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("edgellm: Output folder") and "Pass --force" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_unknown_override_key_suggests_the_right_one(tmp_path, capsys):
    assert main(["export", "max_seq_lne=8", "-o", str(tmp_path / "o")]) == 2
    assert "Did you mean 'max_seq_len'?" in capsys.readouterr().err
    assert main(["export", "coreml.min_iso=17", "--backend", "coreml"]) == 2
    assert "unknown key 'coreml.min_iso'. Did you mean 'coreml.min_ios'?" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_misspelt_flag_gets_the_nearest_one(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--max-seq-lenght", "8"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-seq-lenght" in err
    assert "(did you mean --max-seq-len?)" in err


def test_every_export_option_is_a_flag_and_a_keyword():
    """One list of options: ExportConfig's fields are the YAML keys, the keywords of
    edgellm.export and the flags of `edgellm export` (the model is positional)."""
    import dataclasses

    from edgellm.cli import export_options, flag_of
    from edgellm.config import ExportConfig

    fields = {f.name for f in dataclasses.fields(ExportConfig)} - {"backend_options", "model"}
    assert {f.name for f in export_options()} == fields
    parser = build_parser()
    flags = {a.dest: a.option_strings for a in
             parser._subparsers._group_actions[0].choices["export"]._actions}
    for name in fields:
        assert name in flags, name
    assert flags["backends"] == ["--backend"] and flags["verify"] == ["--no-verify"]
    assert flags["output"] == ["-o", "--output"] and flags["model_class"] == ["--model-class"]
    assert flag_of("max_seq_len") in flags["max_seq_len"]


def test_missing_model_folder(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "o")]) == 2
    assert f"Model path {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_unsupported_model_type(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "falcon_h1"}')
    assert main(["export", str(tmp_path / "m"), "-o", str(tmp_path / "o")]) == 2
    assert "Unsupported model_type 'falcon_h1'. Supported: lfm2, lfm3, llama, mistral, " \
        "ministral, smollm3, qwen2, qwen3, gemma3_text, gemma3, phi3, granite, olmo2, " \
        "qwen3_5_text, qwen3_5, lfm2_moe, qwen3_moe." in \
        capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "edgellm.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "export" in out and "generate" in out


def test_generate_refuses_a_prompt_that_fills_the_context(exported, capsys):
    """A prompt longer than max_seq_len runs in chunks; one that leaves no position for the
    reply (max_context_len 32) is refused, saying so."""
    folder, _ = exported("llama")
    code = main(["generate", str(folder / "model.pte"), "--prompt",
                 "the quick brown fox jumps over the lazy dog " * 4])
    assert code == 2
    err = capsys.readouterr().err
    assert "this program holds max_context_len=32 positions, and the reply needs at least one" \
        in err, err


def test_a_library_failure_is_one_line_exit_3_and_leaves_nothing(tiny_models, tmp_path, capsys,
                                                                  monkeypatch):
    import torch

    import edgellm.capture

    def failing_export(*args, **kwargs):
        return torch.export.export(None, ())  # torch raises from inside its own code

    monkeypatch.setattr(edgellm.capture, "export_methods", failing_export)
    args = ["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"), "--quiet",
            "--max-seq-len", "16"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert err.startswith("edgellm: internal error in torch: ") and err.count("\n") == 1
    assert "Rerun with --debug for the traceback" in err and "Traceback" not in err
    assert "Nothing was written to the output folder." in err  # (export only says so)
    assert not (tmp_path / "o").exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(Exception):
        main(["--debug", *args])


def test_the_exit_codes_documented_are_those_main_returns():
    """cli's docstring and the README list every code `main` can return: the literals it
    returns, and each error type's exit_code."""
    import ast
    import inspect
    import re
    from pathlib import Path

    from edgellm import cli, errors

    returned = {node.value.value for node in ast.walk(ast.parse(inspect.getsource(cli)))
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, int)}
    returned |= {node.body.value for node in ast.walk(ast.parse(inspect.getsource(cli)))
                 if isinstance(node, ast.IfExp) and isinstance(node.body, ast.Constant)
                 and isinstance(node.body.value, int)}
    returned |= {c.exit_code for c in vars(errors).values()
                 if isinstance(c, type) and issubclass(c, errors.EdgeLLMError)}
    documented = {int(n) for n in re.findall(r"\b(\d+) ", cli.__doc__.split("Exit codes")[1])}
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    line = readme[readme.index("- Exit codes:"):].split("\n- ")[0]
    assert documented == returned == {int(n) for n in re.findall(r"\b(\d+) ", line)}, (
        documented, returned)
