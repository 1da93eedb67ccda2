"""Progress of long work: one line per stage with its wall time and the process's peak RSS, the same
figures in report.json, a live line while a stage runs on a terminal, nothing with --quiet."""

import io
import json
import re
import time

from edgellm.cli import main
from edgellm.progress import Stages

LINE = re.compile(r"^\[edgellm\] (\w+) +([\d.]+) s   peak RSS +(\d+) MB$")


def test_stage_lines_match_the_report(tiny_models, tmp_path, capsys):
    """Every stage of a quantized Core ML export, verification's own among them."""
    out = tmp_path / "o"
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(out), "--max-seq-len", "16",
                 "--backend", "coreml", "--quantize", "4w"]) == 0
    lines = [LINE.match(x) for x in capsys.readouterr().err.splitlines()
             if x.startswith("[edgellm] ") and not x.startswith("[edgellm] quantize:")]
    assert all(lines)
    report = json.loads((out / "report.json").read_text())
    names = ["load", "build", "reference", "quantize", "expected", "export", "graph", "lower",
             "serialize", "inspect", "verify"]
    assert [m[1] for m in lines] == [s["name"] for s in report["stages"]] == names
    for m, s in zip(lines, report["stages"]):
        # the line rounds to 0.1 s: within half of it (and a float's rounding)
        assert abs(float(m[2]) - s["wall_s"]) <= 0.05 + 1e-9
        assert abs(int(m[3]) - s["peak_rss_mb"]) <= 1
    peaks = [s["peak_rss_mb"] for s in report["stages"]]
    assert peaks == sorted(peaks) and report["peak_rss_mb"] >= peaks[-1] > 100
    assert sum(s["wall_s"] for s in report["stages"]) <= report["wall_s"]


def test_quiet_prints_nothing_and_json_one_object(tiny_models, tmp_path, capsys):
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"),
                 "--max-seq-len", "16", "--backend", "coreml", "--json", "--no-verify"]) == 0
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


def test_a_stage_counting_its_items_shows_them():
    """`progress(done, total)`: on a terminal the live line ends with done/total; off one (a log)
    a line each time another tenth is done, however large the steps."""
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        stages = Stages(stream=stream, tick=0.05)
        with stages.stage("experts"):
            for done in range(32, 705, 32):  # 22 blocks of 32 experts
                stages.progress(done, 704)
            time.sleep(0.2)
    assert re.search(r"\r\[edgellm\] experts .* MB [|/\-\\] 704/704", tty.getvalue())
    counts = re.findall(r"^\[edgellm\]   (\d+)/704$", pipe.getvalue(), re.M)
    assert [int(c) * 10 // 704 for c in counts] == list(range(1, 11)), counts
