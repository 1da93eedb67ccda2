"""Prefill and decode of any number of .pte files, interleaved in one process: before and after
a change, or a variant beside export_llm's program, on the same weights.

usage: python bench/interleave.py A.pte B.pte [...] [--rounds 5] [--steps 32] [--prompt 64]
           [--decode-only] [--threads N]

Each round measures every program in turn (the order reversed every other round) with
speed_vs_anchor.py's `measure`: the best of 3 one-call prefills and the median single-token
decode call (`--decode-only`: decode alone, for programs that take one token per call). Prints
the median and every round per program; the last line is one JSON object.
"""

import argparse
import json
import statistics

from speed_vs_anchor import measure  # sets OMP_NUM_THREADS=1 before torch loads

import torch  # noqa: E402

from edgellm.run.benchmark import decode_step  # noqa: E402
from edgellm.program import Program, native_logs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="+")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode-only", action="store_true")
    p.add_argument("--threads", type=int, help="ExecuTorch's threadpool size (default: its own, "
                   "one per core)")
    a = p.parse_args()
    if a.threads:
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(a.threads)
    programs = {path: Program(path) for path in a.programs}
    prompt = torch.randint(0, 60000, (a.prompt,), generator=torch.Generator().manual_seed(0))
    runs = {path: {"prefill": [], "decode": []} for path in programs}

    def both(program, steps):  # (prefill tok/s or None, decode tok/s)
        if a.decode_only:
            return None, 1 / decode_step(program, a.prompt, steps)
        return measure(program, prompt.tolist(), steps)

    with native_logs():
        for program in programs.values():  # warm-up: first calls allocate and pack weights
            both(program, 4)
        for r in range(a.rounds):
            for path in list(programs)[::1 if r % 2 == 0 else -1]:
                prefill, decode = both(programs[path], a.steps)
                runs[path]["prefill"].append(prefill and round(prefill, 1))
                runs[path]["decode"].append(round(decode, 2))
    print(f"| program | prefill tok/s ({a.prompt}) | decode tok/s | rounds |\n|---|---|---|---|")
    for path, r in runs.items():
        prefill = "-" if a.decode_only else f"{statistics.median(r['prefill']):.1f}"
        print(f"| {path} | {prefill} | {statistics.median(r['decode']):.2f} | "
              f"{'' if a.decode_only else r['prefill']} / {r['decode']} |")
    print(json.dumps({"rounds": a.rounds, "prompt_tokens": a.prompt, "steps": a.steps,
                      "programs": runs}))


if __name__ == "__main__":
    main()
