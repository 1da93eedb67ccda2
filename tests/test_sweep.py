"""`edgellm sweep` (edgellm/sweeps/, report/pages.py): recipe names, the plan and its
keys, a sweep of a tiny model run here and on a local Ray cluster (the same rows), resuming, a
failed export as a row, and the pages in a real headless browser (Debian's chromium)."""

import json
import os
import shutil
import time
import types
from pathlib import Path

import pytest

import edgellm
from edgellm.errors import InputError
from edgellm.sweeps import estimate_mb, load_rows, plan, recipe_options

from conftest import SIZES, made_once

RECIPES = ["fp32", "8da8w", "8da4w-g32+emb4"]
FAILING = "8da8w+emb4-g7"  # passes the config's checks; the export refuses the group (exit 2)
SHOTS = Path(os.environ.get("EDGELLM_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))


def test_recipe_names_read_into_export_options():
    assert recipe_options("fp32") == {"dtype": "fp32"}
    assert recipe_options("8da4w-g32+emb4+kv8") == {
        "quantize": "8da4w", "group_size": 32, "embedding_quantize": "4", "kv_cache": "int8"}
    assert recipe_options("4w-pc+emb8-g64+fp16") == {
        "quantize": "4w", "group_size": 0, "embedding_quantize": "8,64", "dtype": "fp16"}
    with pytest.raises(InputError, match=r"'8da3w' is not a recipe part; a recipe is parts "
                                         r"joined by '\+'"):
        recipe_options("8da3w+emb4")
    with pytest.raises(InputError, match="'8da8w' sets quantize again"):
        recipe_options("8da4w+8da8w")


def test_plan_leaves_out_what_a_backend_refuses_and_keys_on_inputs(tiny_models, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"][0], folder)
    jobs, skipped = plan(folder, ["xnnpack", "coreml"], ["fp32", "4w", "8da4w"], tmp_path / "o",
                         dict(SIZES))
    assert [j.name for j in jobs] == ["xnnpack-fp32", "xnnpack-8da4w", "coreml-fp32", "coreml-4w"]
    assert len(skipped) == 2 and skipped[0].startswith("xnnpack-4w: quantize: 4w on xnnpack")
    assert skipped[1].startswith("coreml-8da4w: quantize: 8da4w on coreml")
    assert [j.runs_here for j in jobs] == [True, True, False, False]

    def cfg(verify=True, quantize=None):
        return types.SimpleNamespace(verify=verify, quantize=quantize)
    fp32 = estimate_mb(10**9, "xnnpack", cfg())  # a billion parameters: 3815 MB in fp32
    assert fp32 > estimate_mb(10**9, "xnnpack", cfg(verify=False))
    assert fp32 < estimate_mb(10**9, "xnnpack", cfg(quantize="8da4w"))
    assert fp32 < estimate_mb(10**9, "coreml", cfg())  # its build's fp16 copy
    again, _ = plan(folder, ["xnnpack", "coreml"], ["fp32", "4w", "8da4w"], tmp_path / "other",
                    dict(SIZES))
    assert [j.key for j in again] == [j.key for j in jobs]  # the output folder is not an input
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    changed, _ = plan(folder, ["xnnpack", "coreml"], ["fp32", "4w", "8da4w"], tmp_path / "o",
                      dict(SIZES))
    assert not {j.key for j in changed} & {j.key for j in jobs}
    wider, _ = plan(folder, ["xnnpack"], ["fp32"], tmp_path / "o", {**SIZES, "max_seq_len": 8})
    assert wider[0].key != jobs[0].key
    with pytest.raises(InputError, match="unknown key 'max_seq_lne'. Did you mean 'max_seq_len'"):
        plan(folder, ["xnnpack"], ["fp32"], tmp_path / "o", {"max_seq_lne": 8})
    with pytest.raises(InputError, match=f"model: {tmp_path / 'nothing'} not found"):
        plan(tmp_path / "nothing", ["xnnpack"], ["fp32"], tmp_path / "o", {})


@pytest.fixture(scope="module")
def swept(tiny_models, shared_dir):
    """(folder, rows) of a sweep of the tiny Llama here: three recipes and one that fails."""
    out = shared_dir / "sweep-local"
    made_once(out, lambda: edgellm.sweep(tiny_models["llama"][0], backends="xnnpack",
                                         recipes=RECIPES + [FAILING], output=out, quiet=True,
                                         **SIZES))
    return out, load_rows(out)


def test_a_sweep_writes_a_row_per_export_with_the_reports_figures(swept):
    out, rows = swept
    assert [r["name"] for r in rows] == [f"xnnpack-{r}" for r in RECIPES + [FAILING]]
    for row in rows[:3]:
        report = json.loads((out / row["name"] / "report.json").read_text())
        assert row["status"] == "ok" and row["error"] is None
        assert row["pte_bytes"] == report["pte_bytes"] == (out / row["name"] / "model.pte"
                                                           ).stat().st_size
        checks = {c["level"]: c for c in report["verify"]["checks"]}
        cost = checks.get("quantization") or checks["program"]
        assert row["accuracy"]["top1"] == round(cost["top1"], 4)
        assert row["accuracy"]["perplexity"] == report["verify"]["perplexity"]["program"]
        assert row["speed"]["decode_tok_s"] > 0 and row["speed"]["prefill_tok_s"] > 0
        assert row["speed"]["prompt_tokens"] == SIZES["max_seq_len"]
        assert row["export_s"] > 0 and row["peak_rss_mb"] > 200
        assert (out / row["name"] / "report.html").stat().st_size > 1e6  # Plotly inlined
    assert [r["pte_bytes"] for r in rows[:3]] == sorted((r["pte_bytes"] for r in rows[:3]),
                                                        reverse=True)
    failed = rows[3]
    assert failed["status"] == "failed" and "pte_bytes" not in failed
    assert "embedding_quantize: group 7 does not divide the embedding" in failed["error"]
    assert "group 7 does not divide" in (out / "logs" / f"{FAILING_NAME}.log").read_text()
    lines = (out / "results.csv").read_text().splitlines()
    assert lines[0].startswith("name,backend,recipe,status,pte_bytes,accuracy.sqnr_db")
    assert len(lines) == 5 and lines[4].startswith(f"{FAILING_NAME},xnnpack,{FAILING},failed,")


FAILING_NAME = f"xnnpack-{FAILING}"


def test_a_second_sweep_redoes_only_the_failed_export_and_keeps_the_other_rows(
        swept, tiny_models, tmp_path, capsys, monkeypatch):
    """Through the CLI: its table of the rows, and exit 1 for the export that failed again."""
    import edgellm.sweeps
    from edgellm.cli import main

    monkeypatch.setattr(edgellm.sweeps, "available_mb", lambda: 1000)  # below any estimate
    out = tmp_path / "again"  # a copy: other tests read the shared sweep
    shutil.copytree(swept[0], out)
    rows = swept[1]
    logs = {r["name"]: (out / "logs" / f"{r['name']}.log").stat().st_mtime_ns for r in rows}
    sizes = [f"{k}={v}" for k, v in SIZES.items()]
    assert main(["sweep", str(tiny_models["llama"][0]), "--recipes", f"{RECIPES[0]},{FAILING}",
                 "-o", str(out), *sizes]) == 1
    captured = capsys.readouterr()
    assert "2 exports: 1 done before, 1 to run, 1 at once at most here" in captured.err
    assert (f"{FAILING_NAME}: its estimated peak, 1000 MB, is above the 900 MB this machine has "
            "for the sweep; it runs alone") in captured.err
    assert f"1 of 2 exports not ok ({FAILING_NAME})" in captured.err
    lines = captured.out.splitlines()
    assert lines[0].split() == ["export", "status", "MB", "SQNR", "dB", "top-1", "perplexity",
                                "decode", "tok/s", "export", "s"]
    assert [line.split()[:2] for line in lines[1:]] == [["xnnpack-fp32", "ok"],
                                                        [FAILING_NAME, "failed"]]
    after = {r["name"]: (out / "logs" / f"{r['name']}.log").stat().st_mtime_ns for r in rows}
    assert [n for n in logs if logs[n] != after[n]] == [FAILING_NAME]
    again = load_rows(out)  # the rows of the first sweep's other recipes stay in the table
    assert again[0] == rows[0] and again[1]["status"] == "failed"
    assert [r["name"] for r in again] == [rows[0]["name"], FAILING_NAME, rows[1]["name"],
                                          rows[2]["name"]]


def test_a_sweep_on_a_local_ray_cluster_gives_the_same_rows(swept, tiny_models, tmp_path,
                                                            capsys):
    out, rows = swept
    ray_rows = edgellm.sweep(tiny_models["llama"][0], backends="xnnpack", recipes=RECIPES,
                             output=tmp_path / "ray", ray="local", bench=False, **SIZES)
    cpus = os.cpu_count()
    assert f"3 tasks submitted to Ray ({cpus} CPUs in the cluster)" in capsys.readouterr().err
    same = ("name", "backend", "recipe", "status", "key", "pte_bytes", "accuracy", "error")
    assert [{k: r[k] for k in same} for r in ray_rows] == [{k: r[k] for k in same}
                                                           for r in rows[:3]]
    assert all("speed" not in r for r in ray_rows)


FAKE_LLAMA_CPP = """
import ctypes, json, os
import numpy as np
__version__ = "fake"
class _Ctx:
    ctx = None
class Llama:  # llama-cpp-python's calls the sweep makes; every logit 0 but a hair more at one
    def __init__(self, model_path, **kw):  # token, FAKE_TOP (perplexity n_vocab, argmax it)
        self.seen, self._ctx, self.row = [], _Ctx(), np.zeros(Llama.VOCAB, dtype=np.float32)
        self.row[int(os.environ["FAKE_TOP"])] = 1e-6
        global _llm
        _llm = self
    def n_vocab(self):
        return Llama.VOCAB
    def eval(self, tokens):
        self.seen += list(tokens)
        with open(os.environ["FAKE_SEEN"], "w") as f:
            json.dump(self.seen, f)
    def reset(self):
        self.seen.append(-1)
Llama.VOCAB = int(os.environ["FAKE_VOCAB"])
def llama_get_logits_ith(ctx, i):
    return _llm.row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
"""


def test_a_sweep_beside_a_gguf_adds_llama_cpp_s_row_on_the_same_text(swept, tiny_models,
                                                                     tmp_path, capsys):
    """`--beside FILE.gguf`: the file run by llama.cpp (here a stand-in llama_cpp whose logits
    are all 0 but a hair above at fp32's most frequent argmax, so its perplexity is the
    vocabulary's size and its top-1 that token's share) along the very ids the exports'
    perplexity was measured on (its top-1 against fp32's argmax there, which the report keeps),
    then a prefill and greedy steps as the exports' bench: one more row, last, in results.json,
    the CSV, the page and the printed table; without llama_cpp in the interpreter, one line and
    exit 2 before any export."""
    import sys

    from edgellm.cli import main
    from edgellm.sources.base import load_tokenizer
    from edgellm.verification import text_tokens

    out = tmp_path / "beside"
    shutil.copytree(swept[0], out)
    gguf = Path(__file__).parent / "data" / "gguf" / "llama-Q4_K_M.gguf"
    args = ["sweep", str(tiny_models["llama"][0]), "--recipes", RECIPES[0], "-o", str(out),
            *[f"{k}={v}" for k, v in SIZES.items()], "--beside", str(gguf)]
    assert main(args) == 2  # this interpreter has no llama_cpp
    assert "cannot import llama_cpp; install it there" in capsys.readouterr().err
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    report = json.loads((out / swept[1][0]["name"] / "report.json").read_text())
    fp32 = report["verify"]["perplexity"]["fp32_argmax"]
    top = max(set(fp32), key=fp32.count)  # the stand-in's argmax: fp32's most frequent one
    os.environ.update(FAKE_VOCAB="160", FAKE_SEEN=str(tmp_path / "seen.json"), FAKE_TOP=str(top))
    try:
        assert main(args + ["--llamacpp-python", str(python)]) == 0
    finally:
        del os.environ["FAKE_VOCAB"], os.environ["FAKE_SEEN"], os.environ["FAKE_TOP"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].split()[:2] == [f"llama.cpp-{gguf.stem}", "ok"]
    rows = load_rows(out)
    row, first = rows[-1], swept[1][0]
    assert [r["name"] for r in rows[:-1]] == [r["name"] for r in swept[1] if r["status"] == "ok"]
    ids = text_tokens(load_tokenizer(tiny_models["llama"][0]),
                      report["verify"]["perplexity"]["tokens"])
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen[:len(ids) - 1] == ids[:-1] and seen[len(ids) - 1] == -1  # the text, then reset
    assert len(seen) == len(ids) + first["speed"]["prompt_tokens"] + first["speed"][
        "decode_steps"]
    assert (row["backend"], row["recipe"], row["status"]) == ("llama.cpp", gguf.name, "ok")
    assert row["pte_bytes"] == gguf.stat().st_size
    assert row["accuracy"]["perplexity"] == pytest.approx(160, rel=1e-4)
    assert len(fp32) == len(ids) - 1 and row["accuracy"]["text_top1"] == round(
        fp32.count(top) / len(fp32), 4) > 0
    assert row["accuracy"]["perplexity_fp32"] == report["verify"]["perplexity"][
        "transformers_fp32"]
    assert row["speed"]["decode_tok_s"] > 0 and row["speed"]["prefill_tok_s"] > 0
    assert (out / "results.csv").read_text().splitlines()[-1].startswith(
        f"llama.cpp-{gguf.stem},llama.cpp,{gguf.name},ok,{gguf.stat().st_size},")
    page = (out / "index.html").read_text()
    assert "The llama.cpp row is the file given beside the sweep" in page
    assert f'href="llama.cpp-{gguf.stem}/report.html"' not in page


# --- the pages, in Debian's chromium ----------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("the page tests drive Debian's chromium: apt-get install chromium "
                    "chromium-driver (`bash run.sh test` does, as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000",
                "--host-resolver-rules=MAP * ~NOTFOUND"):  # offline: a page must need nothing
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def load(driver, path: Path) -> list[dict]:
    """Open the page; the console's errors and warnings while it loaded and drew."""
    driver.get_log("browser")  # what earlier pages left
    driver.get(path.as_uri())
    deadline = time.time() + 30
    while driver.execute_script("return document.readyState") != "complete":
        assert time.time() < deadline, f"{path} did not load"
        time.sleep(0.1)
    time.sleep(0.5)  # Plotly draws after the load event
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def points(driver, chart: str) -> tuple[int, int]:
    """(points in the chart's shown export traces, point markers Plotly drew for them)."""
    return driver.execute_script(f"""
        var div = document.getElementById('{chart}');
        var shown = div.data.filter(function(t){{return t.meta === 'exports' && t.visible;}});
        var n = shown.reduce(function(n, t){{return n + t.x.length;}}, 0);
        return [n, div.querySelectorAll('.scatterlayer .trace .points path.point').length];""")


def column(driver, header: str) -> list[str]:
    heads = [th.text for th in driver.find_elements("css selector", "#exports th")]
    i = heads.index(header)
    return [tr.find_elements("css selector", "td")[i].text
            for tr in driver.find_elements("css selector", "#exports tbody tr")]


def test_the_index_page_charts_every_export_and_its_table_sorts(swept, browser):
    out, rows = swept
    assert load(browser, out / "index.html") == []
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "sweep-index.png"))
    made = [r for r in rows if r["status"] != "failed"]
    assert points(browser, "accuracy") == [len(made), len(made)]
    assert points(browser, "speed") == [len(made), len(made)]
    fronts = browser.execute_script(
        "return document.getElementById('accuracy').data.filter(function(t){"
        "return t.meta === 'pareto' && t.visible;}).map(function(t){return t.x.length;})")
    assert fronts and all(n >= 1 for n in fronts)
    assert column(browser, "export") == [r["name"] for r in rows]
    header = next(th for th in browser.find_elements("css selector", "#exports th")
                  if th.text == ".pte MB")
    header.click()
    sizes = [float(x) for x in column(browser, ".pte MB") if x]
    assert sizes == sorted(sizes) and len(sizes) == len(made)
    assert column(browser, ".pte MB")[-1] == ""  # the failed export: no program, last
    header.click()
    sizes = [float(x) for x in column(browser, ".pte MB") if x]
    assert sizes == sorted(sizes, reverse=True)
    link = browser.find_element("link text", made[0]["name"])
    assert link.get_attribute("href") == (out / made[0]["name"] / "report.html").as_uri()


def test_an_exports_report_page_draws_its_charts(swept, browser):
    out, rows = swept
    folder = out / rows[2]["name"]
    assert load(browser, folder / "report.html") == []
    browser.save_screenshot(str(SHOTS / "export-report.png"))
    report = json.loads((folder / "report.json").read_text())
    bars = browser.execute_script(
        "return document.getElementById('delegation').data.map(function(t){return t.y[0];})")
    d = report["methods"]["forward"]["delegation"]
    assert bars[:2] == [d["delegated_nodes"], d["non_delegated_compute_nodes"]]
    stages = browser.execute_script("return document.getElementById('stages').data[0].x")
    assert stages == [s["name"] for s in report["stages"]]
    assert len(browser.find_elements("css selector", "#delegation .bars path")) >= 2
    assert "quantization" in browser.find_element("tag name", "body").text


def test_explore_serves_the_program_in_model_explorer(exported):
    """`edgellm explore OUT --no-browser`: Model Explorer's server, whose PTE adapter reads the
    program into a graph holding its XNNPACK delegate."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.parse
    import urllib.request

    folder, _ = exported("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "explore", str(folder),
                             "--no-browser", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                assert urllib.request.urlopen(url, timeout=5).status == 200
                break
            except OSError:
                assert time.time() < deadline, "Model Explorer did not start"
                time.sleep(0.5)
        command = {"extensionId": "pte_adapter_model_explorer", "cmdId": "convert",
                   "modelPath": str(folder / "model.pte"), "settings": {},
                   "deleteAfterConversion": False}
        query = urllib.parse.quote(json.dumps(command))
        graphs = urllib.request.urlopen(f"{url}/api/v1/send_command?json={query}",
                                        timeout=60).read().decode()
        assert "XnnpackBackend" in graphs and '"forward"' in graphs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_ctrl_c_stops_a_sweep_and_the_exports_it_started(tiny_models, tmp_path):
    """SIGINT to the sweep alone (as `kill -INT` sends it, not a terminal to the whole group):
    the exports it started are interrupted too, and nothing is left half-written."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "o"
    child = subprocess.Popen(
        [sys.executable, "-m", "edgellm.cli", "sweep", str(tiny_models["llama"][0]), "--recipes",
         "fp32,8da8w", "-o", str(out), "--workers", "2", "--no-bench", "max_seq_len=16",
         "max_context_len=32"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # see test_interrupts
    for line in child.stderr:
        if "started xnnpack-8da8w" in line:
            break
    time.sleep(1)  # the exports are under way (a tiny one may finish in 3 s on a busy machine)
    child.send_signal(signal.SIGINT)
    rest = child.stderr.read()
    assert child.wait(60) == 130, rest
    assert "edgellm: interrupted; results.json keeps the exports done" in rest

    def exports_running():
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if str(out) in (proc / "cmdline").read_text():
                    found.append(proc.name)
            except OSError:
                continue
        return found
    deadline = time.time() + 30
    while exports_running():
        assert time.time() < deadline, "the sweep's exports went on after it was interrupted"
        time.sleep(0.2)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".xnnpack-")]
    assert not (out / "xnnpack-fp32").exists() and not (out / "xnnpack-8da8w").exists()
