"""An export stopped half-way leaves nothing at its destination: Ctrl-C removes its temporary
folder on the way out; a killed run (SIGKILL, no chance to clean up) leaves one that the next export
to the same destination recognises by its process id and removes, and that export succeeds."""

import os
import signal
import subprocess
import sys

import pytest

import edgellm


def start_export(folder, out):
    """The CLI in a child process, once its build stage has ended: export, lower and serialize
    are still to come."""
    child = subprocess.Popen(
        [sys.executable, "-m", "edgellm.cli", "export", str(folder), "-o", str(out),
         "--backend", "coreml", "--max-seq-len", "16", "--no-verify"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        # as from a terminal: a worker of the suite can have come to ignore SIGINT, which a
        # child inherits, and Python then never raises KeyboardInterrupt in it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in child.stderr:
        if line.startswith("[edgellm] build"):
            return child
    child.wait()
    pytest.fail(f"export ended (exit {child.returncode}) before its build stage did")


def leftovers(out):
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_ctrl_c_leaves_nothing(tiny_models, tmp_path):
    out = tmp_path / "o"
    child = start_export(tiny_models["llama"][0], out)
    child.send_signal(signal.SIGINT)
    rest = child.stderr.read()
    assert child.wait(timeout=120) == 130, rest[-2000:]
    assert "edgellm: interrupted; nothing was written to the output folder" in rest
    assert "Traceback" not in rest
    assert not out.exists() and leftovers(out) == []


def test_killed_export_is_cleaned_up_by_the_next_one(tiny_models, tmp_path):
    out = tmp_path / "o"
    child = start_export(tiny_models["llama"][0], out)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    assert not out.exists()
    [stale] = leftovers(out)
    assert stale.startswith(f".o.partial-{child.pid}-")
    edgellm.export(tiny_models["llama"][0], output=out, backends="coreml", max_seq_len=16,
                   verify=False, quiet=True)
    assert (out / "model.pte").is_file() and leftovers(out) == []


def test_a_running_exports_folder_is_left_alone(tiny_models, tmp_path):
    out = tmp_path / "o"
    alive = tmp_path / f".o.partial-{os.getpid()}-abc"  # this test process is alive
    alive.mkdir()
    edgellm.export(tiny_models["llama"][0], output=out, backends="coreml", max_seq_len=16,
                   verify=False, quiet=True)
    assert alive.is_dir()
