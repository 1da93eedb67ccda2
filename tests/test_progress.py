"""Progress of long work: one line per stage with its wall time and the process's peak RSS, the same
figures in report.json, a live line while a stage runs on a terminal, nothing with --quiet."""

import gc
import io
import json
import os
import re
import time
import weakref

import pytest
import torch

from edgellm import progress
from edgellm.cli import main
from edgellm.config import ExportConfig
from edgellm.progress import Stages

LINE = re.compile(r"^\[edgellm\] (\w+) +([\d.]+) s   peak RSS +(\d+) MB$")


def test_stage_lines_match_the_report(tiny_models, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(out), "--max-seq-len", "16",
                 "--quantize", "8da4w", "--group-size", "32"]) == 0
    lines = [LINE.match(x) for x in capsys.readouterr().err.splitlines() if x.startswith("[")]
    assert all(lines)
    report = json.loads((out / "report.json").read_text())
    names = ["load", "build", "reference", "quantize", "export", "lower", "serialize", "verify"]
    assert [m[1] for m in lines] == [s["name"] for s in report["stages"]] == names
    for m, s in zip(lines, report["stages"]):
        assert abs(float(m[2]) - s["wall_s"]) <= 0.05 and abs(int(m[3]) - s["peak_rss_mb"]) <= 1
    peaks = [s["peak_rss_mb"] for s in report["stages"]]
    assert peaks == sorted(peaks) and report["peak_rss_mb"] >= peaks[-1] > 100
    assert sum(s["wall_s"] for s in report["stages"]) <= report["wall_s"]


def test_quiet_prints_nothing_and_json_one_object(tiny_models, tmp_path, capsys):
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"),
                 "--max-seq-len", "16", "--json", "--no-verify"]) == 0
    captured = capsys.readouterr()
    assert "[edgellm]" not in captured.err
    assert json.loads(captured.out)["stages"][0]["name"] == "load"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_live_line_on_a_terminal_only():
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        with Stages(stream=stream, tick=0.05).stage("lower"):
            time.sleep(0.3)
    live = re.findall(r"\r\[edgellm\] lower +[\d.]+ s   RSS +\d+ MB [|/\-\\]", tty.getvalue())
    assert len(live) >= 3 and tty.getvalue().endswith(" MB\n")
    assert "\r" not in pipe.getvalue() and LINE.match(pipe.getvalue().strip())


def resident_kb(path) -> int:
    """Rss of this process's mappings of `path`."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = len(fields) > 5 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_checkpoint_pages_are_dropped_unless_written(tmp_path):
    from safetensors.torch import load_file, save_file

    weights = {"a": torch.randn(512, 1024), "b": torch.randn(256, 1024)}
    read, written = tmp_path / "read.safetensors", tmp_path / "written.safetensors"
    save_file(weights, read)
    save_file(weights, written)
    mapped = load_file(read)
    other = load_file(written)
    other["b"][0, 0] = 1.0  # a private mapping's written page: dropping it would lose the write
    assert float(sum(t.sum() for t in [*mapped.values(), *other.values()])) != 0  # every page
    before = resident_kb(read.resolve())
    assert before >= 3 * 1024
    assert progress.drop_mapped_pages([read, written]) * 1024 >= before - 1024
    assert resident_kb(read.resolve()) < 64 and resident_kb(written.resolve()) >= 3 * 1024
    assert all(torch.equal(mapped[k], weights[k]) for k in weights)  # faulted back in
    assert other["b"][0, 0] == 1.0
    assert progress.drop_mapped_pages([]) == 0


def test_export_sets_the_cycle_collector_for_its_run_and_puts_it_back(tiny_models, tmp_path,
                                                                      monkeypatch):
    """From the end of `load` the objects alive are frozen and young collections wait (see
    progress.long_run_collector); the caller's collector comes back as it was, also when a stage
    fails."""
    from edgellm import pipeline

    before, seen = gc.get_threshold(), []
    monkeypatch.setattr(pipeline, "release_memory", lambda: seen.append(
        (gc.get_freeze_count(), gc.get_threshold())))
    model = str(tiny_models["llama"][0])
    assert main(["export", model, "-o", str(tmp_path / "o"), "--max-seq-len", "16",
                 "--no-verify"]) == 0
    assert seen and all(n > 10_000 and t[0] == progress.YOUNG_COLLECTION_EVERY for n, t in seen)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before

    def fail(*a, **k):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr("edgellm.lower.lower", fail)  # export imports it when it runs
    with pytest.raises(RuntimeError, match="lowering failed"):
        pipeline.export(ExportConfig(model=model, output=str(tmp_path / "f"), max_seq_len=16,
                                     verify=False), quiet=True)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_the_long_run_still_frees_the_cycles_it_drops_and_keeps_a_callers_freeze():
    class Node:
        pass

    with progress.long_run_collector():
        node = Node()
        node.itself, node.payload = node, torch.zeros(1 << 20)
        alive = weakref.ref(node)
        del node
        progress.release_memory()
        assert alive() is None
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        # neither frozen again (the count would grow by what was allocated since) nor thawed (0);
        # frozen objects reference counting frees meanwhile make the count drop a little
        with progress.long_run_collector():
            assert 0 < gc.get_freeze_count() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
