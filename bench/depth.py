"""Prefill and decode of any number of .pte files at context depths, interleaved in one process:
`edgellm bench --depth` for several programs at once (edgellm's and export_llm's, fp32 and int8
caches), so that their ratios come from one run.

usage: python bench/depth.py NAME=A.pte NAME=B.pte [...] [--depths 0,1024,2048,4000]
           [--rounds 3] [--steps 32] [--prompt 64]

At each depth (ascending) every program's context is first filled to that depth (random tokens,
continuing the last depth's), then each round measures every program in turn (order reversed
every other round): the best of 3 prefills of `--prompt` tokens at that depth and the median
single-token decode call from it. Prints the median per program and depth; the last line is
one JSON object. Cache bytes a step reads come from each program's report.json where it has one
(edgellm's), for the floor; export_llm's programs have none.
"""

import argparse
import json
import statistics
from pathlib import Path

import speed_vs_anchor  # noqa: F401  sets OMP_NUM_THREADS=1 before torch loads

import torch  # noqa: E402

from edgellm.run.benchmark import (bandwidth_gbs, cache_bytes_read, decode_step,  # noqa: E402
                               report_of, timed)
from edgellm.program import Program, native_logs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="+", metavar="NAME=PTE")
    p.add_argument("--depths", default="0,1024,2048,4000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    a = p.parse_args()
    programs = {n: Program(path) for n, path in (x.split("=", 1) for x in a.programs)}
    depths = sorted(int(d) for d in a.depths.split(","))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 40000, (a.prompt,), generator=g).tolist()
    runs = {n: {d: {"prefill": [], "decode": []} for d in depths} for n in programs}
    filled = 0
    with native_logs():
        for program in programs.values():  # warm-up: first calls allocate and pack weights
            program.prefill(prompt[:8])
        for d in depths:
            fill = torch.randint(0, 40000, (d - filled,), generator=g).tolist()
            for program in programs.values():  # in pieces of 64: export_llm's programs take
                for j in range(0, len(fill), 64):  # at most max_seq_len - 1 tokens a call
                    program.prefill(fill[j:j + 64], filled + j)
            filled = d
            for r in range(a.rounds):
                for name in list(programs)[::1 if r % 2 == 0 else -1]:
                    program = programs[name]
                    prefill = min(timed(lambda: program.prefill(prompt, d)) for _ in range(3))
                    runs[name][d]["prefill"].append(round(a.prompt / prefill, 1))
                    runs[name][d]["decode"].append(round(1 / decode_step(program, d, a.steps), 2))
    bw = bandwidth_gbs()
    table = {}
    print(f"| program | depth | prefill tok/s ({a.prompt}) | decode tok/s | bytes a step reads "
          "| of the floor |\n|---|---|---|---|---|---|")
    for name, program in programs.items():
        report = report_of(program.path)
        for d in depths:
            prefill = statistics.median(runs[name][d]["prefill"])
            decode = statistics.median(runs[name][d]["decode"])
            read = None
            if report:
                read = report["weight_bytes_per_token"] + cache_bytes_read(report, d)
            fraction = read / (bw * 1e9) * decode if read else None
            table.setdefault(name, {})[d] = {
                "prefill_tok_s": prefill, "decode_tok_s": decode, "bytes_read": read,
                "floor_fraction": fraction and round(fraction, 3), "rounds": runs[name][d]}
            print(f"| {name} | {d} | {prefill:.1f} | {decode:.2f} | "
                  f"{'-' if read is None else f'{read / 1e6:.0f} MB'} | "
                  f"{'-' if fraction is None else f'{fraction:.0%}'} |")
    print(json.dumps({"prompt_tokens": a.prompt, "steps": a.steps, "rounds": a.rounds,
                      "bandwidth_gbs": round(bw, 2), "programs": {
                          n: str(Path(p.path)) for n, p in programs.items()}, "by_depth": table}))


if __name__ == "__main__":
    main()
