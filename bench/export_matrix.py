"""Export cost per stage, model x recipe x backend, in one run: each export in its own process,
one after another, so that the host's drift touches every row alike.

usage: python bench/export_matrix.py OUTDIR [--models smollm2 lfm2.5-350m=DIR q4km=FILE.gguf]
                                            [--recipes fp32 8da4w default]
                                            [--backends xnnpack coreml] [--verify] [--sha]
                                            [--twins]

`smollm2` is the embedded SmolLM2-135M GGUF (8da4w with its `--embedding-quantize 4,32`, as the
README's recipe); NAME=DIR any Hugging Face folder (LFM2.5-350M: ../shared/bench/anchor.sh's
OUTDIR/hf; Qwen3-0.6B: bench/make_checkpoint.py on bench/params/); NAME=FILE.gguf any GGUF.
`default` is no recipe at all (a GGUF keeps its own quantization), on every backend; `fp32` asks
for `--dtype fp32`. Core ML takes no other recipe (its quantized recipes are weight-only). Each
row: the process's wall time from outside (imports included), the report's wall time, peak RSS
and stages, the program's size; `--sha` adds its sha256 (to show a change left the bytes alone).
A GGUF row also gets its peak against 3x the file's bytes plus the toolchain's fixed cost: the
peak of the same export of tests/data/gguf/llama-Q4_K_M.gguf (a 1 MB file of 2 layers), run
first, or with `--twins` of the file's thin twin (bench/thin_twin.py: its family, layers,
vocabulary and file type, 64 wide), whose graph is the file's own. A program
that fails a verification check (random weights at 4 bits fail the recipe's accuracy bound)
keeps its row, marked. A table, then one JSON object per row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

EDGELLM = [str(Path(sys.executable).parent / "edgellm")]  # the venv's command
FIXED = Path(__file__).parent.parent / "tests" / "data" / "gguf" / "llama-Q4_K_M.gguf"


def recipe_args(model: str, recipe: str, backend: str) -> list[str] | None:
    if recipe == "default":
        return []
    if recipe == "fp32":
        return ["--dtype", "fp32"]
    if backend != "xnnpack":
        return None
    return ["--quantize", recipe] + (["--embedding-quantize", "4,32"] if model == "smollm2" else [])


def export(name: str, source: str | None, recipe: str, backend: str, out: Path, verify: bool,
           sha: bool) -> dict | None:
    args = recipe_args(name, recipe, backend)
    if args is None:
        return None
    dest = out / f"{name}-{recipe}-{backend}"
    cmd = EDGELLM + ["export"] + ([source] if source else []) + [
        "--backend", backend, "-o", str(dest), "--force", "--quiet", "--json"] + args
    cmd += [] if verify else ["--no-verify"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    row = dict(model=name, recipe=recipe, backend=backend, ok=done.returncode == 0,
               process_wall_s=round(time.perf_counter() - t0, 1))
    written = dest / "report.json"
    if done.returncode == 1 and written.is_file():  # written, verified, failed a check
        report = json.loads(written.read_text())
        row["verified"] = "failed: " + ", ".join(
            c["level"] for c in report["verify"]["checks"] if not c["passed"])
    elif done.returncode != 0:
        return dict(row, error=(done.stderr.strip().splitlines() or ["?"])[-1])
    else:
        report = json.loads(done.stdout)
    row.update(export_wall_s=round(report["wall_s"], 1), peak_rss_mb=round(report["peak_rss_mb"]),
               pte_mb=round(report["pte_bytes"] / 2**20, 1),
               stages={s["name"]: round(s["wall_s"], 1) for s in report["stages"]})
    if sha:
        row["sha256"] = hashlib.sha256((dest / "model.pte").read_bytes()).hexdigest()[:16]
    return row


def twin(source: str, path: Path) -> Path:
    """The thin twin of the GGUF at `source` (bench/thin_twin.py), written once."""
    if not path.exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "thin_twin.py"), source,
                        str(path)], check=True, capture_output=True)
    return path


def bound(row: dict) -> str:
    if "peak_bound_mb" not in row:
        return ""
    return (f" ({'within' if row['peak_within_bound'] else 'OVER'} {row['peak_bound_mb']}: "
            f"3 x {row['gguf_mb']} + {row['fixed_cost_mb']})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--models", nargs="+", default=["smollm2"])
    p.add_argument("--recipes", nargs="+", default=["fp32", "8da4w"])
    p.add_argument("--backends", nargs="+", default=["xnnpack", "coreml"])
    p.add_argument("--verify", action="store_true")
    p.add_argument("--sha", action="store_true")
    p.add_argument("--twins", action="store_true",
                   help="a GGUF's fixed cost from its thin twin, not the 1 MB fixture")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, fixed = [], {}
    for spec in a.models:
        name, _, source = spec.partition("=")
        for backend in a.backends:
            for recipe in a.recipes:
                gguf = source.endswith(".gguf")
                key = (name if a.twins else None, backend, recipe)
                if gguf and key not in fixed:
                    base = twin(source, out / f"twin-{name}.gguf") if a.twins else FIXED
                    first = export(f"fixed-cost-{base.stem}", str(base), recipe, backend, out,
                                   False, False)
                    fixed[key] = first and first.get("peak_rss_mb")
                row = export(name, source or None, recipe, backend, out, a.verify, a.sha)
                if row and gguf and row.get("peak_rss_mb") and fixed[key]:
                    file_mb = Path(source).stat().st_size / 2**20
                    row.update(gguf_mb=round(file_mb, 1), fixed_cost_mb=fixed[key],
                               peak_bound_mb=round(3 * file_mb + fixed[key]))
                    row["peak_within_bound"] = row["peak_rss_mb"] <= row["peak_bound_mb"]
                if row:
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print("| model | recipe | backend | wall s (process) | peak MB (bound: 3x GGUF + fixed) | "
          "stages s | .pte MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        stages = ", ".join(f"{k} {v}" for k, v in r.get("stages", {}).items())
        print(f"| {r['model']} | {r['recipe']} | {r['backend']} | {r.get('export_wall_s')} "
              f"{'(' + r['verified'] + ') ' if 'verified' in r else ''}"
              f"({r['process_wall_s']}) | {r.get('peak_rss_mb')}{bound(r)} | {stages or r.get('error')} | "
              f"{r.get('pte_mb')} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
