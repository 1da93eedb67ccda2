"""The programs of an `edgellm sweep`, timed again one after another in rounds, beside llama.cpp
on the same GGUF: what the sweep's own speed column cannot give (it times each program once,
and no other tool).

usage: python bench/recipes.py SWEEPDIR [--rounds 2] [--llamacpp [GGUF]]

Every export in SWEEPDIR/results.json whose program ran its bench there is measured again with
`edgellm bench` (64-token prefill, 32 decode steps), ROUNDS times, interleaved with llama.cpp
(bench/others.py, /tmp/llamacpp-venv; the GGUF defaults to the embedded SmolLM2's); the medians
of the rounds are printed as a table, and the last line is one JSON list of the rows.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def bench_row(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", str(folder),
                          "--prompt-lengths", "64", "--steps", "32"],
                         capture_output=True, text=True)
    b = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill_tok_s": b["prefill_tok_s"]["64"], "decode_tok_s": b["decode_tok_s"],
            "floor_fraction": b["floor_fraction"]}


def llamacpp_row(gguf: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "others.py"), "llamacpp", gguf],
                         capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill_tok_s": r.get("prefill_tok_s"), "decode_tok_s": r.get("decode_tok_s")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llamacpp", nargs="?", const="", metavar="GGUF")
    a = p.parse_args()
    names = [r["name"] for r in json.loads((a.sweep / "results.json").read_text())
             if "decode_tok_s" in (r.get("speed") or {})]
    runs: dict[str, list[dict]] = {}
    sys.path.insert(0, str(HERE))
    for _ in range(a.rounds):
        if a.llamacpp is not None:
            import others

            gguf = a.llamacpp or str(others.smollm2_gguf())
            runs.setdefault(f"llama.cpp {Path(gguf).name}", []).append(llamacpp_row(gguf))
        for name in names:
            runs.setdefault(name, []).append(bench_row(a.sweep / name))
    rows = [{"program": name, "rounds": len(rs),
             **{k: round(statistics.median(r[k] for r in rs), 3)
                for k in ("prefill_tok_s", "decode_tok_s", "floor_fraction") if k in rs[0]}}
            for name, rs in runs.items()]
    print("| program | prefill tok/s (64) | decode tok/s | decode / floor |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['program']} | {r['prefill_tok_s']} | {r['decode_tok_s']} | "
              f"{r.get('floor_fraction', '')} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
