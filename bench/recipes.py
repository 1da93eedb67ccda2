"""Every quantization recipe on one model: size, accuracy against fp32 and speed, one row each.

usage: python bench/recipes.py [MODEL] OUTDIR [--recipes NAME ...] [--max-seq-len 512]
           [--llamacpp]

MODEL defaults to the embedded SmolLM2-135M GGUF. Each recipe is exported with the CLI in its own
process (export wall time and peak RSS from /usr/bin/time; the export's verification gives the
accuracy), then `edgellm bench` measures prefill (64 tokens) and decode on this machine for
programs that run here (Core ML programs are sized and checked, not timed). Accuracy: verify's
quantization check (SQNR and top-1 of the program's logits against transformers in fp32, along
the shipped text) and, along the same text, perplexity and top-1 agreement with fp32.
`--llamacpp` adds llama.cpp on the same GGUF (bench/others.py, /tmp/llamacpp-venv) in the same
run. The last line is one JSON list of the rows.

`--speed-only ROUNDS` exports nothing: it measures the recipes already in OUTDIR (and llama.cpp
with `--llamacpp`) one after another, ROUNDS times, on what should be a quiet machine, and reports
the median of the rounds per program.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RECIPES = {
    "fp32": [],
    "8da8w": ["--quantize", "8da8w"],
    "8da8w+emb8": ["--quantize", "8da8w", "--embedding-quantize", "8"],
    # the default 4-bit recipe; from a Q4_0/Q4_1/Q4_K GGUF, group 32 keeps the file's grid
    "8da4w+emb4": ["--quantize", "8da4w", "--embedding-quantize", "4,32"],
    "8da4w-g32": ["--quantize", "8da4w", "--group-size", "32"],
    "8da4w-g64": ["--quantize", "8da4w", "--group-size", "64"],
    "8da4w-g128": ["--quantize", "8da4w", "--group-size", "128"],
    "8da4w-per-channel": ["--quantize", "8da4w", "--group-size", "0"],
    "8da4w-g32+emb4": ["--quantize", "8da4w", "--group-size", "32",
                       "--embedding-quantize", "4,32"],
    "8da4w-g128+emb4": ["--quantize", "8da4w", "--group-size", "128",
                        "--embedding-quantize", "4,32"],
    "8da4w-g32+emb8": ["--quantize", "8da4w", "--group-size", "32",
                       "--embedding-quantize", "8"],
    "coreml-fp16": ["--backend", "coreml"],
    "coreml-4w-g32": ["--backend", "coreml", "--quantize", "4w"],
    "coreml-4w-per-channel": ["--backend", "coreml", "--quantize", "4w", "--group-size", "0"],
    "coreml-8w": ["--backend", "coreml", "--quantize", "8w"],
    "coreml-4w-g32+emb4": ["--backend", "coreml", "--quantize", "4w",
                           "--embedding-quantize", "4,32"],
}


def export_row(model, out: Path, name: str, max_seq_len: int) -> dict:
    args = RECIPES[name]
    if "--backend" not in args:
        args = ["--backend", "xnnpack", *args]
    folder = out / name
    log = out / f"{name}.log"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "edgellm.cli", "export",
           *([model] if model else []), "-o", str(folder), "--force", "--quiet",
           "--max-seq-len", str(max_seq_len), *args]
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    row = {"recipe": name, "args": args, "exit": code}
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)",
                     text)
    if rss and wall:
        row["export_peak_rss_mb"] = int(rss.group(1)) // 1024
        row["export_wall_s"] = round(int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60
                                     + float(wall.group(3)), 1)
    report = folder / "report.json"
    if not report.is_file():
        row["error"] = text.strip().splitlines()[-1] if text.strip() else "no output"
        return row
    r = json.loads(report.read_text())
    row["pte_mb"] = round(r["pte_bytes"] / 1e6, 1) if "pte_bytes" in r else round(
        (folder / "model.pte").stat().st_size / 1e6, 1)
    checks = {c["level"]: c for c in r.get("verify", {}).get("checks", [])}
    cost = checks.get("quantization") or checks.get("program") or checks.get("exported graph")
    if cost:
        row.update(sqnr_db=round(cost["sqnr_db"], 1), top1=round(cost["top1"], 3),
                   verified=r["verify"]["passed"])
    ppl = r.get("verify", {}).get("perplexity")
    if ppl:
        row["ppl_fp32"] = ppl["transformers_fp32"]
        row["ppl"] = ppl.get("program", ppl.get("exported_graph"))
        row["text_top1"] = ppl["top1_vs_fp32"]
    if r.get("backends", ["xnnpack"])[0] != "coreml" and code in (0, 1):
        bench = subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", str(folder),
                                "--prompt-lengths", "64", "--steps", "32"],
                               capture_output=True, text=True)
        if bench.returncode == 0:
            b = json.loads(bench.stdout.strip().splitlines()[-1])
            row.update(prefill_tok_s=b["prefill_tok_s"]["64"], decode_tok_s=b["decode_tok_s"],
                       floor_fraction=b["floor_fraction"], bandwidth_gbs=b["bandwidth_gbs"])
    return row


def bench_row(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", str(folder),
                          "--prompt-lengths", "64", "--steps", "32"], capture_output=True, text=True)
    b = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill_tok_s": b["prefill_tok_s"]["64"], "decode_tok_s": b["decode_tok_s"],
            "floor_fraction": b["floor_fraction"]}


def speed_only(model, out: Path, names: list[str], rounds: int, llamacpp: bool) -> list[dict]:
    import statistics

    runs: dict[str, list[dict]] = {}
    for _ in range(rounds):
        if llamacpp:
            import others

            row = llamacpp_row(model or others.smollm2_gguf())
            runs.setdefault(row["recipe"], []).append(row)
        for name in names:
            if (out / name / "model.pte").is_file() and "coreml" not in name:
                runs.setdefault(name, []).append(bench_row(out / name))
    return [{"recipe": name, "rounds": len(rs),
             **{k: round(statistics.median(r[k] for r in rs), 3)
                for k in ("prefill_tok_s", "decode_tok_s", "floor_fraction") if k in rs[0]}}
            for name, rs in runs.items()]


def llamacpp_row(gguf: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "others.py"), "llamacpp", gguf],
                         capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"recipe": "llama.cpp " + Path(gguf).name, "prefill_tok_s": r.get("prefill_tok_s"),
            "decode_tok_s": r.get("decode_tok_s"), "error": r.get("error")}


COLUMNS = ("recipe", "pte_mb", "sqnr_db", "top1", "ppl_fp32", "ppl", "text_top1",
           "prefill_tok_s", "decode_tok_s", "floor_fraction", "export_wall_s",
           "export_peak_rss_mb")


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "-")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="[MODEL] OUTDIR")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--llamacpp", action="store_true")
    p.add_argument("--speed-only", type=int, metavar="ROUNDS")
    a = p.parse_args()
    model, out = (None, Path(a.paths[0])) if len(a.paths) == 1 else (a.paths[0], Path(a.paths[1]))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    if a.speed_only:
        rows = speed_only(model, out, a.recipes, a.speed_only, a.llamacpp)
        print(table(rows))
        print(json.dumps(rows))
        return
    rows = []
    with open(out / "recipes.jsonl", "a") as log:
        if a.llamacpp:
            import others

            rows.append(llamacpp_row(model or others.smollm2_gguf()))
            log.write(json.dumps(rows[-1]) + "\n")
        for name in a.recipes:
            rows.append(export_row(model, out, name, a.max_seq_len))
            log.write(json.dumps(rows[-1]) + "\n")
            log.flush()
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
