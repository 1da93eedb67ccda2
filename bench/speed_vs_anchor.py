"""Prefill and decode of two programs of the same weights, interleaved in one process: ExecuTorch
`export_llm`'s .pte (from ../shared/bench/anchor.sh) and edgellm's, through the same runtime.

usage: python bench/speed_vs_anchor.py ANCHOR.pte EDGELLM_OUT [--rounds 5] [--steps 32]
           [--prompt 64]

Each round measures a 64-token prefill (the best of 3, each in one call where the program's T is
dynamic, else a token per call: Program.prefill) and the median of `steps` single-token decode
calls for one program, then the other, alternating which goes first. Figures are medians over
rounds; decode is also given against the memory-bandwidth floor: weights read per token (from
edgellm's report) over the bandwidth measured right before that program's decode in that round, so
a drifting host moves both sides of each ratio together. The fraction is the median over rounds;
`decode_floor_fraction_best_bw` divides the median decode by the best bandwidth of the run
instead (a pessimistic bound). The last line is one JSON object.
"""

import argparse
import json
import statistics
from pathlib import Path

from edgellm.run.openmp import one_thread_per_team

one_thread_per_team()  # before torch is imported (edgellm/run/openmp.py); both programs alike

import torch  # noqa: E402

from edgellm.run.benchmark import bandwidth_gbs, decode_step, timed  # noqa: E402
from edgellm.program import Program, native_logs  # noqa: E402


def measure(program, prompt: list[int], steps: int, calls: int = 3) -> tuple[float, float]:
    """Prefill: the best of `calls` prefills of the prompt as the program takes it (one call
    when its T is dynamic, a token a call when T is 1); decode: the median single-token call."""
    prefill_s = min(timed(lambda: program.prefill(prompt)) for _ in range(calls))
    return len(prompt) / prefill_s, 1 / decode_step(program, len(prompt), steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("anchor")
    p.add_argument("edgellm")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    a = p.parse_args()
    out = Path(a.edgellm)
    programs = {"export_llm": Program(a.anchor), "edgellm": Program(out / "model.pte")}
    weights = json.loads((out / "report.json").read_text())["weight_bytes_per_token"]
    prompt = torch.randint(0, 60000, (a.prompt,), generator=torch.Generator().manual_seed(0))
    runs = {name: {"prefill": [], "decode": [], "fraction": []} for name in programs}
    with native_logs():
        for name in programs:  # warm-up: first calls allocate and pack weights
            measure(programs[name], prompt.tolist(), 4)
        bandwidths = []
        for r in range(a.rounds):
            order = list(programs) if r % 2 == 0 else list(reversed(programs))
            for name in order:
                bandwidths.append(bandwidth_gbs(repeats=3))
                prefill, decode = measure(programs[name], prompt.tolist(), a.steps)
                runs[name]["prefill"].append(prefill)
                runs[name]["decode"].append(decode)
                runs[name]["fraction"].append(decode * weights / (bandwidths[-1] * 1e9))
    bw = max(bandwidths)
    floor_tok_s = bw * 1e9 / weights
    result = {"rounds": a.rounds, "bandwidths_gbs": [round(b, 1) for b in bandwidths], "steps": a.steps, "prompt_tokens": a.prompt,
              "weight_bytes_per_token": weights, "bandwidth_gbs": round(bw, 2),
              "floor_decode_tok_s": round(floor_tok_s, 2)}
    for name, r in runs.items():
        result[name] = {"prefill_tok_s": round(statistics.median(r["prefill"]), 1),
                        "decode_tok_s": round(statistics.median(r["decode"]), 2),
                        "decode_floor_fraction": round(statistics.median(r["fraction"]), 3),
                        "decode_floor_fraction_best_bw": round(statistics.median(r["decode"]) /
                                                               floor_tok_s, 3),
                        "decode_all": [round(x, 2) for x in r["decode"]],
                        "prefill_all": [round(x, 1) for x in r["prefill"]],
                        "fraction_all": [round(x, 3) for x in r["fraction"]]}
    for k in ("prefill_tok_s", "decode_tok_s"):
        result[f"{k}_ratio"] = round(result["edgellm"][k] / result["export_llm"][k], 3)
    print("| figure | export_llm | edgellm | ratio |\n|---|---|---|---|")
    for k in ("prefill_tok_s", "decode_tok_s", "decode_floor_fraction",
              "decode_floor_fraction_best_bw"):
        a_, e = result["export_llm"][k], result["edgellm"][k]
        print(f"| {k} | {a_} | {e} | {round(e / a_, 3)} |")
    print(f"\nbest bandwidth {result['bandwidth_gbs']} GB/s, {weights / 1e9:.3f} GB of weights per "
          f"token: floor {result['floor_decode_tok_s']} tok/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
