"""A sweep: one model exported in every recipe on every backend, each export verified and (where
its backend runs here) benchmarked, into one folder with a row per export.

    DIR/<backend>-<recipe>/   the export (model.pte, report.json, report.html, ...)
    DIR/configs/<name>.yaml   its resolved config (`edgellm export --config` replays it)
    DIR/logs/<name>.log       what its export and bench printed
    DIR/results.json, .csv    a row per export: size, accuracy, speed, export time and peak, status
    DIR/index.html            the rows as charts and a sortable table (sweep_page.py)

Every export is `edgellm export` in a process of its own, started by the same function whether
the sweep runs here (as many at once as memory allows) or as Ray tasks (sweeps/ray.py): the rows
are the same either way. A row is reused when its export's config, input files and library
versions are those of the row (`key`), so an interrupted or extended sweep does only what is new;
a failed export is a row with its error, and is tried again by the next sweep. Benchmarks run
after every export is done, one at a time, so no export competes with them for the cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import ConfigError, InputError
from . import llamacpp

# A recipe name is parts joined by "+": a dtype, a linear recipe with an optional group, an
# embedding recipe with an optional group, int8 KV caches. "-pc" is per channel (group 0).
RECIPE_PARTS = (
    (r"(fp32|fp16|bf16)", lambda m: {"dtype": m[1]}),
    (r"(8da4w|8da8w|4w|8w)(?:-g(\d+)|-(pc))?",
     lambda m: {"quantize": m[1], **({"group_size": int(m[2])} if m[2] else {}),
                **({"group_size": 0} if m[3] else {})}),
    (r"emb(8|4)(?:-g(\d+)|-(pc))?",
     lambda m: {"embedding_quantize": m[1] + (f",{m[2]}" if m[2] else ",0" if m[3] else "")}),
    (r"kv8", lambda m: {"kv_cache": "int8"}),
)
RECIPE_GRAMMAR = ("parts joined by '+': fp32|fp16|bf16; 8da4w|8da8w|4w|8w with -gN (group N) or "
                  "-pc (per channel); emb8|emb4 with -gN or -pc; kv8 (int8 KV caches); e.g. "
                  "fp32, 8da4w, 8da4w-g32+emb4, 4w-pc, 8da8w+emb8+kv8")
BENCH_PROMPT, BENCH_STEPS = 64, 32  # tokens, as bench/ scripts measure
LIBRARIES = ("edgellm", "executorch", "torch", "torchao", "transformers", "coremltools")
RESULTS = ("results.json", "results.csv", "index.html")


def recipe_options(recipe: str) -> dict:
    """'8da4w-g32+emb4' -> {'quantize': '8da4w', 'group_size': 32, 'embedding_quantize': '4,0'
    ...}: ExportConfig fields. Raises InputError with the grammar for a name it cannot read."""
    out: dict = {}
    for part in recipe.split("+"):
        for pattern, options in RECIPE_PARTS:
            m = re.fullmatch(pattern, part)
            if m:
                taken = set(out) & set(options(m))
                if taken:
                    raise InputError(f"recipe {recipe!r}: '{part}' sets {', '.join(taken)} again")
                out.update(options(m))
                break
        else:
            raise InputError(f"recipe {recipe!r}: '{part}' is not a recipe part; a recipe is "
                             f"{RECIPE_GRAMMAR}")
    return out


@dataclasses.dataclass(frozen=True)
class Job:
    name: str  # the export's folder under DIR: <backend>-<recipe>
    model: str  # the checkpoint's path
    backend: str
    recipe: str
    config: str  # the export's resolved config, as YAML
    key: str  # a digest of the config, the input files and the libraries' versions
    estimate_mb: int  # the export's peak RSS, estimated (estimate_mb)
    runs_here: bool  # can this machine's ExecuTorch runtime run the program (bench)


def plan(model, backends: list[str], recipes: list[str], output: Path,
         overrides: dict) -> tuple[list[Job], list[str]]:
    """The jobs of a sweep, and a line for each (backend, recipe) the export's own validation
    refuses (e.g. a weight-only recipe on XNNPACK), which is left out."""
    from ..backends import BACKENDS
    from ..config import dump_yaml, from_dict

    if not backends or not recipes:
        raise InputError("a sweep needs at least one backend (--backends) and one recipe "
                         "(--recipes)")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise InputError(f"backends: {', '.join(unknown)} not one of {', '.join(BACKENDS)} (a "
                         "sweep exports to each backend alone)")
    options = {r: recipe_options(r) for r in recipes}
    path = model_path(model).resolve()
    if not path.exists():
        raise InputError(f"model: {model} not found")
    inputs, params, libraries = fingerprint(model, overrides), parameter_count(model), versions()
    jobs, skipped = [], []
    for backend in backends:
        common = {k: v for k, v in overrides.items() if k not in BACKENDS or k == backend}
        # what every export takes, refused at once (not as every pair left out)
        from_dict({**common, "backends": [backend], "model": str(path) if model else None})
        for recipe in recipes:
            name = f"{backend}-{recipe}"
            data = {**common, **_precision(BACKENDS[backend], options[recipe], common),
                    **options[recipe], "backends": [backend],
                    "model": str(path) if model else None, "output": str(output / name)}
            try:
                cfg = from_dict(data)
            except ConfigError as e:
                skipped.append(f"{name}: {'; '.join(e.problems)}")
                continue
            text = dump_yaml(cfg)
            keyed = json.dumps([re.sub(r"(?m)^output: .*$", "", text), inputs, libraries])
            jobs.append(Job(name, str(path), backend, recipe, text,
                            hashlib.sha256(keyed.encode()).hexdigest(),
                            estimate_mb(params, backend, cfg), BACKENDS[backend].runs_here))
    return jobs, skipped


def _precision(backend, options: dict, common: dict) -> dict:
    """A recipe's dtype is also the compute precision of a backend that has one of its own
    (Core ML's `precision`, fp16 unless told), so `coreml-fp32` computes in fp32."""
    names = {f.name for f in dataclasses.fields(backend.options)}
    if "dtype" not in options or "precision" not in names or options["dtype"] == "bf16":
        return {}
    return {backend.name: {**common.get(backend.name, {}), "precision": options["dtype"]}}


def model_path(model) -> Path:
    from ..sources import default_model_path

    return Path(model) if model else default_model_path()


def fingerprint(model, overrides: dict) -> list:
    """Name, size and modification time of every input file (the model's, params, tokenizer)."""
    paths = [model_path(model)] + [Path(overrides[k]) for k in ("params", "tokenizer")
                                   if overrides.get(k)]
    out = []
    for path in paths:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        out += [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def parameter_count(model) -> int:
    """Parameters of the checkpoint, from file headers (nothing is read in full)."""
    path = model_path(model)
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    if path.is_dir():
        count = 0
        for file in path.glob("*.safetensors"):
            with open(file, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            count += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
        return count
    import torch

    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return sum(t.numel() for t in state.values() if hasattr(t, "numel"))


BASE_MB = 1000  # torch, ExecuTorch and transformers imported, before any weight
BYTES_PER_PARAMETER = 6  # the float model, and the exported and lowered programs' copies
VERIFY_BYTES = 2  # verification: transformers' fp32 model beside edgellm's
QUANTIZE_BYTES = 2  # a linear recipe: the float weights and their quantized copy at once


def estimate_mb(parameters: int, backend: str, cfg) -> int:
    """An export's peak RSS, from above: float weights, the exported and lowered programs'
    copies, (verify) transformers' fp32 model, (a linear recipe) the quantized copies, and what
    the backend's build holds more (Core ML's fp16 copy). A mixture of experts quantized in a
    stream takes far less than this says."""
    from ..backends import get_backend

    per = (BYTES_PER_PARAMETER + VERIFY_BYTES * cfg.verify + QUANTIZE_BYTES * bool(cfg.quantize)
           + get_backend(backend).build_bytes_per_parameter)
    return BASE_MB + parameters * per // 2**20


# --- one export, one benchmark: what a worker (a thread here or a Ray task) runs -----------------

def run_export(job: Job, output: str, threads: int | None = None) -> dict:
    """Export `job` into OUTPUT/<name> with `edgellm export` in its own process; the row.
    `threads`: its OpenMP team (OMP_NUM_THREADS), where several exports share the cores."""
    out = Path(output)
    config = out / "configs" / f"{job.name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(job.config)
    row = first_fields(job)
    code, wall, peak, text = _run([sys.executable, "-m", "edgellm.cli", "export", "--config",
                                   str(config), "--force", "--quiet"], out, job.name, "w",
                                  threads)
    row.update(export_s=round(wall, 1), peak_rss_mb=round(peak))
    report = out / job.name / "report.json"
    if code in (0, 1) and report.is_file():
        row.update(from_report(json.loads(report.read_text())))
        row["status"] = "ok" if code == 0 else "verification failed"
        row["error"] = None if code == 0 else _last_line(text)
    else:
        row.update(status="failed", error=_last_line(text) or f"exit code {code}")
    return row


def first_fields(job: Job) -> dict:
    """What a row says before its export ran."""
    return {"name": job.name, "model": job.model, "backend": job.backend, "recipe": job.recipe,
            "key": job.key, "host": socket.gethostname(), "estimated_peak_mb": job.estimate_mb}


def run_bench(name: str, output: str) -> dict:
    """`edgellm bench` of OUTPUT/<name>: {"prompt_tokens", "prefill_tok_s", "decode_tok_s"}, or
    {"bench_error"}. The prompt is BENCH_PROMPT tokens and decode BENCH_STEPS steps, or what the
    program's context holds of them."""
    out = Path(output)
    r = json.loads((out / name / "report.json").read_text())
    prompt = max(1, min(BENCH_PROMPT, r["max_seq_len"], r["max_context_len"] // 2))
    steps = max(1, min(BENCH_STEPS, r["max_context_len"] - prompt))
    code, _, _, text = _run([sys.executable, "-m", "edgellm.cli", "bench", str(out / name),
                             "--prompt-lengths", str(prompt), "--steps", str(steps)],
                            out, name, "a")
    if code != 0:
        return {"bench_error": _last_line(text) or f"exit code {code}"}
    b = json.loads(text.strip().splitlines()[-1])
    return {"prompt_tokens": prompt, "decode_steps": steps,
            "prefill_tok_s": b["prefill_tok_s"][str(prompt)], "decode_tok_s": b["decode_tok_s"]}


RUNNING: set = set()  # the processes _run started that are still running (interrupt them)


def _run(cmd: list[str], out: Path, name: str, mode: str,
         threads: int | None = None) -> tuple[int, float, float, str]:
    """cmd's exit code, wall time, peak RSS (MB, from its own rusage) and output, also appended
    to OUTPUT/logs/<name>.log; `threads` sets OMP_NUM_THREADS unless the environment does."""
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = os.environ.copy()
    if threads and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    RUNNING.add(proc)
    try:
        text = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        RUNNING.discard(proc)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    with open(log, mode) as f:
        f.write(f"$ {' '.join(cmd)}\n{text}")
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss / 1024, text


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def from_report(r: dict) -> dict:
    """A row's figures from an export's report.json, all against transformers in fp32: the
    perplexity of the shipped text and the top-1 agreement along it; SQNR and top-1 of the
    check that measures the recipe (quantization), else for an fp32 program its own check (or,
    a backend that does not run here, the exported graph's). A program in another dtype is
    checked against its own dtype's model: no SQNR against fp32 for it."""
    checks = {c["level"]: c for c in r.get("verify", {}).get("checks", [])}
    cost = checks.get("quantization")
    if cost is None and r["dtype"] == "fp32":
        cost = checks.get("program") or checks.get("exported graph")
    ppl = r.get("verify", {}).get("perplexity") or {}
    accuracy = {"sqnr_db": round(cost["sqnr_db"], 2) if cost else None,
                "top1": round(cost["top1"], 4) if cost else None,
                "perplexity": ppl.get("program", ppl.get("exported_graph")),
                "perplexity_fp32": ppl.get("transformers_fp32"),
                "text_top1": ppl.get("top1_vs_fp32")}
    return {"pte_bytes": r["pte_bytes"], "accuracy": accuracy,
            "verified": r["verify"]["passed"] if "verify" in r else None,
            "weight_bytes_per_token": r.get("weight_bytes_per_token")}


# --- the sweep ------------------------------------------------------------------------------------

def sweep(model=None, *, backends, recipes, output, workers: int | None = None,
          ray: str | None = None, bench: bool = True, quiet: bool = False,
          beside: str | None = None, llamacpp_python: str | None = None,
          **overrides) -> list[dict]:
    """Export `model` in each recipe on each backend into `output` (see the module's docstring);
    returns the rows, also written to results.json, results.csv and index.html. `overrides` are
    ExportConfig fields every export takes (max_seq_len, verify, ...). `workers`: exports at
    once at most here (default: the cores; memory may allow fewer); `ray`: an address, or
    "local" for a Ray cluster on this machine, to run each export as a Ray task. `beside`: a
    GGUF run by llama.cpp (llama-cpp-python in `llamacpp_python`, default this interpreter)
    as one more row, last (sweeps/llamacpp.py)."""
    out = Path(output).resolve()
    if isinstance(backends, str):
        backends = [b for b in backends.split(",") if b]
    if isinstance(recipes, str):
        recipes = [r for r in recipes.split(",") if r]
    for name in ("backends", "model", "output", "force"):
        if name in overrides:
            raise InputError(f"{name}: a sweep sets it per export; give it to the sweep itself")

    def say(text: str) -> None:
        if not quiet:
            print(f"[sweep] {text}", file=sys.stderr, flush=True)

    jobs, skipped = plan(model, list(backends), list(recipes), out, overrides)
    python = llamacpp_python or sys.executable
    gguf = beside and llamacpp.check(beside, python)
    for line in skipped:
        say(f"left out {line}")
    if not jobs:
        raise InputError("every backend and recipe pair was left out (above): nothing to export")
    out.mkdir(parents=True, exist_ok=True)
    previous = {row["name"]: row for row in load_rows(out)}
    rows = {j.name: previous[j.name] for j in jobs if reusable(previous.get(j.name), j, out)}
    todo = [j for j in jobs if j.name not in rows]
    # rows of an earlier sweep of the same model into DIR stay in its table (an extended sweep)
    kept = [row for name, row in previous.items() if name not in {j.name for j in jobs}
            and row.get("model") == jobs[0].model and row.get("status") != "failed"
            and (out / name / "model.pte").is_file()]

    beside_rows: list[dict] = []  # llama.cpp's, last

    def table() -> list[dict]:
        return [rows[j.name] for j in jobs if j.name in rows] + kept + beside_rows

    say(f"{len(jobs)} exports: {len(rows)} done before, {len(todo)} to run"
        + ("" if not todo or ray else f", {_at_once(todo, workers)} at once at most here"))
    have = None if ray else available_mb()
    for job in todo:
        if have and job.estimate_mb > have * MEMORY_SHARE:
            say(f"{job.name}: its estimated peak, {job.estimate_mb} MB, is above the "
                f"{have * MEMORY_SHARE:.0f} MB this machine has for the sweep; it runs alone")
    started, runner = time.perf_counter(), None
    try:
        if todo:
            runner = _ray_runner(ray) if ray else _local_runner(_at_once(todo, workers))
            for row in runner.exports(todo, str(out), say):
                rows[row["name"]] = row
                say(f"[{len(rows)}/{len(jobs)}] {describe(row)}")
                write_results(out, table())
        timed = [j for j in jobs if bench and j.runs_here and rows[j.name]["status"] != "failed"
                 and "decode_tok_s" not in (rows[j.name].get("speed") or {})]
        for job in timed:
            runner = runner or (_ray_runner(ray) if ray else _local_runner(1))
            rows[job.name]["speed"] = runner.bench(job.name, str(out))
            say(f"bench {job.name}: {describe_speed(rows[job.name]['speed'])}")
            write_results(out, table())
    finally:
        if runner:
            runner.close()
    if gguf:
        beside_rows.append(beside_row(model, gguf, python, out, table(),
                                      previous.get(f"{llamacpp.BACKEND}-{gguf.stem}"),
                                      overrides.get("tokenizer")))
        say(describe(beside_rows[0]))
    write_results(out, table())
    say(f"{len(todo)} exported in {time.perf_counter() - started:.0f} s; {out / 'index.html'}")
    return [rows[j.name] for j in jobs] + beside_rows


def beside_row(model, gguf: Path, python: str, out: Path, rows: list[dict],
               previous: dict | None, tokenizer: str | None = None) -> dict:
    """llama.cpp's row for `gguf`, along the ids and lengths the exports' rows were measured
    with (their first verified report; without one, the text's first 128 tokens and the bench's
    own lengths); an earlier sweep's row stands while what it depends on is unchanged."""
    text = {}
    for r in rows:
        report = out / r["name"] / "report.json"
        if not text and r.get("status") != "failed" and report.is_file():
            text = json.loads(report.read_text()).get("verify", {}).get("perplexity") or {}
    timed = next((r["speed"] for r in rows if "prompt_tokens" in (r.get("speed") or {})), {})
    prompt, steps = timed.get("prompt_tokens", BENCH_PROMPT), timed.get("decode_steps",
                                                                       BENCH_STEPS)
    ids = llamacpp.text_ids(model, text.get("tokens", 128), tokenizer)
    if (previous and previous.get("status") == "ok"
            and previous.get("key") == llamacpp.key(gguf, python, ids, prompt, steps)):
        return previous
    return llamacpp.row(gguf, python, ids, text, prompt, steps)


def reusable(row: dict | None, job: Job, out: Path) -> bool:
    """A row from an earlier sweep stands if its export's key is the job's, it did not fail, and
    its program is still there."""
    return (row is not None and row.get("key") == job.key and row.get("status") != "failed"
            and (out / job.name / "model.pte").is_file())


def load_rows(out: Path) -> list[dict]:
    path = out / "results.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def write_results(out: Path, rows: list[dict]) -> None:
    """results.json, results.csv and index.html, each replaced whole (a reader never sees half)."""
    from ..report.pages import sweep_page

    texts = {"results.json": json.dumps(rows, indent=2) + "\n", "results.csv": csv_text(rows),
             "index.html": sweep_page(rows, title=f"edgellm sweep: {out.name}")}
    for name, text in texts.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)


CSV_COLUMNS = ("name", "backend", "recipe", "status", "pte_bytes", "accuracy.sqnr_db",
               "accuracy.top1", "accuracy.perplexity", "accuracy.perplexity_fp32",
               "accuracy.text_top1", "speed.prefill_tok_s", "speed.decode_tok_s", "export_s",
               "peak_rss_mb", "estimated_peak_mb", "host", "error")


def csv_text(rows: list[dict]) -> str:
    import csv
    import io

    from ..report.pages import value as field

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(["" if field(row, c) is None else field(row, c) for c in CSV_COLUMNS])
    return buf.getvalue()


def describe(row: dict) -> str:
    if row["backend"] == llamacpp.BACKEND and row["status"] == "failed":
        return f"{row['name']}: FAILED: {row['error']}"
    if row["status"] == "failed":
        return f"{row['name']}: FAILED after {row['export_s']} s: {row['error']}"
    acc = row["accuracy"]
    figures = ", ".join(f"{label} {acc[k]:.3g}" for k, label in (
        ("sqnr_db", "SQNR dB"), ("top1", "top-1"), ("perplexity", "perplexity"))
        if acc.get(k) is not None)
    return (f"{row['name']}: {row['status']}, {row['pte_bytes'] / 1e6:.1f} MB"
            + (f", {figures}" if figures else "")
            + ("" if row["export_s"] is None else
               f", {row['export_s']} s, peak {row['peak_rss_mb']} MB"))


def summary_table(rows: list[dict]) -> str:
    """The rows as a terminal table: what `edgellm sweep` prints when it ends."""
    head = ("export", "status", "MB", "SQNR dB", "top-1", "perplexity", "decode tok/s", "export s")
    lines = []
    for r in rows:
        acc, speed = r.get("accuracy") or {}, r.get("speed") or {}
        cells = (r["name"], r["status"], r.get("pte_bytes") and r["pte_bytes"] / 1e6,
                 acc.get("sqnr_db"), acc.get("text_top1"), acc.get("perplexity"),
                 speed.get("decode_tok_s"), r.get("export_s"))
        lines.append(["" if c is None else f"{c:.4g}" if isinstance(c, float) else str(c)
                      for c in cells])
    widths = [max(len(x) for x in column) for column in zip(head, *lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
                     for line in [list(head), *lines])


def describe_speed(speed: dict) -> str:
    if "bench_error" in speed:
        return f"FAILED: {speed['bench_error']}"
    return (f"prefill {speed['prefill_tok_s']:.1f} tok/s, decode {speed['decode_tok_s']:.1f} "
            "tok/s")


def available_mb() -> int | None:
    from ..memory import available_bytes

    have = available_bytes()
    return have // 2**20 if have else None


def _at_once(jobs: list[Job], workers: int | None) -> int:
    have = available_mb()
    largest = max(j.estimate_mb for j in jobs)
    by_memory = max(1, int(have * MEMORY_SHARE) // largest) if have else 1
    return max(1, min(workers or os.cpu_count() or 1, by_memory, len(jobs)))


MEMORY_SHARE = 0.9  # of the memory available when the sweep starts, for its exports


class _local_runner:
    """Exports as processes on this machine: a new one starts while the estimated peaks of those
    running and its own fit in the memory available at the start (one runs alone whatever its
    estimate), up to `workers` at once. With more than one, each export's OpenMP team gets its
    share of the cores: teams of the default size (every core) in two processes spin-wait
    against each other, and two exports at once took longer than one after the other."""

    def __init__(self, workers: int):
        self.workers = workers  # _at_once: what the cores, the memory and the user allow
        self.threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None

    def exports(self, jobs: list[Job], output: str, say):
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        budget = int((available_mb() or 0) * MEMORY_SHARE) or None
        pending, running = list(jobs), {}
        with ThreadPoolExecutor(self.workers) as pool, _interrupting_children():
            while pending or running:
                used = sum(j.estimate_mb for j in running.values())
                for job in list(pending):
                    fits = budget is None or used + job.estimate_mb <= budget or not running
                    if len(running) < self.workers and fits:
                        pending.remove(job)
                        running[pool.submit(run_export, job, output, self.threads)] = job
                        used += job.estimate_mb
                        say(f"started {job.name} (estimated peak {job.estimate_mb} MB)")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    del running[future]
                    yield future.result()

    def bench(self, name: str, output: str) -> dict:
        return run_bench(name, output)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _interrupting_children():
    """Ctrl-C (or any error) in the sweep interrupts the exports it started (a terminal sends
    them SIGINT too, but a `kill -INT` of the sweep alone would leave them running), so the
    pool's threads end; each export removes its partial folder."""
    try:
        yield
    except BaseException:
        for proc in list(RUNNING):
            proc.send_signal(signal.SIGINT)
        raise


def _ray_runner(address: str):
    from .ray import RayRunner

    return RayRunner(address, run_export, run_bench, first_fields)
