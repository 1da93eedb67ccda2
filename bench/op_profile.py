"""Where a program's prefill and decode time goes, per operator, from ExecuTorch's own profiler.

    python bench/op_profile.py PTE [PTE ...] [--prompt-len 64] [--steps 64]

Each program is loaded with ETDump profiling on (ExecuTorch's wheel records every operator call
and, inside the XNNPACK delegate, every XNNPACK operator) twice: to run a prompt three times from
position 0, then to run `--steps` single-token calls after one more. Printed per program: prefill
(the fastest of the last two prompt runs) and decode (the mean per token; a cond branch's events
count on the calls that ran them) in microseconds, split into XNNPACK's
GEMMs (fully connected), other XNNPACK work, and each operator outside the delegates. Profiling
adds a few microseconds per event, so totals read a little above `edgellm bench`. The last line
is one JSON object with every figure.

The GEMMs' share says what a faster program could still win: decode that is nearly all GEMM is
bound by XNNPACK's kernels (and so by memory bandwidth), whatever the graph around them. It runs
with OMP_NUM_THREADS=1 unless set (edgellm/run/openmp.py: `llama::custom_sdpa`'s BLAS otherwise
starts OpenMP teams that contend with XNNPACK's threadpool in this Python process).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

from edgellm.run.openmp import one_thread_per_team

one_thread_per_team()  # before torch is imported


def profile(pte: Path, prompt_len: int, steps: int) -> dict:
    import torch

    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = [(ids, torch.tensor([0]))] * 3  # the first run also plans and packs: not counted
    decode = [(torch.tensor([[1 + i % 50]]), torch.tensor([prompt_len + i]))
              for i in range(steps + 1)]  # the first, a warm-up: not counted
    return {"prefill_us": split(_per_run(pte, prompt, skip=1, best=True)),
            "decode_us": split(_per_run(pte, decode, skip=1, best=False))}


def _per_run(pte: Path, calls: list, skip: int, best: bool) -> collections.Counter:
    """Microseconds per call of `forward` for each event, over `calls` run in a program loaded
    with ETDump on, the first `skip` not counted: the fastest call's (`best`) or the mean. The
    Inspector gives one block of events a call when the calls ran different events (a cond's
    branches), else one block whose events hold a duration per call."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama:: kernels
    import executorch.kernels.quantized  # noqa: F401  quantized embeddings
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    module = portable_lib._load_for_executorch(str(pte), enable_etdump=True, debug_buffer_size=0)
    for args in calls:
        module.run_method("forward", args)
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "etdump.etdp"
        module.write_etdump_result_to_file(str(dump))
        blocks = [[e for e in block.events if e.perf_data is not None]
                  for block in Inspector(etdump_path=str(dump)).event_blocks
                  if block.name == "Execute"]
    runs = [collections.Counter() for _ in calls]  # per call: event name -> us
    for events in blocks if len(blocks) == len(calls) else [None]:
        for event in events if events is not None else blocks[0]:
            raw = event.perf_data.raw  # ms: one per call its block covers
            name = re.sub(r" #\d+$", "", event.name)
            for i, ms in enumerate(raw if events is None else [sum(raw)]):
                runs[i if events is None else blocks.index(events)][name] += ms * 1000
    counted = runs[skip:]
    if best:
        return min(counted, key=lambda run: run["Method::execute"])
    return collections.Counter({name: sum(run[name] for run in counted) / len(counted)
                                for name in set().union(*counted)})


def split(times: collections.Counter) -> dict:
    """Total, XNNPACK GEMMs, the rest of the delegates, and each operator outside them (us)."""
    gemm = sum(v for k, v in times.items() if k.startswith("Fully Connected"))
    delegates = times.get("DELEGATE_CALL", 0.0)
    outside = {k.removeprefix("native_call_"): round(v, 1) for k, v in times.most_common()
               if k not in ("Method::execute", "DELEGATE_CALL", "OPERATOR_CALL")
               and (k.startswith("native_call_") or "::" in k)}
    return {"total": round(times.get("Method::execute", 0.0), 1), "gemm": round(gemm, 1),
            "delegates_other": round(delegates - gemm, 1),
            "outside_delegates": round(times.get("OPERATOR_CALL", 0.0), 1),
            "operators_outside": outside}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ptes", nargs="+", type=Path)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args(argv)
    results = {}
    for pte in a.ptes:
        pte = pte / "model.pte" if pte.is_dir() else pte
        r = results[str(pte)] = profile(pte, a.prompt_len, a.steps)
        print(f"\n{pte}")
        for phase in ("prefill_us", "decode_us"):
            f = r[phase]
            print(f"  {phase[:-3]:8s} {f['total']:9.1f} us: GEMM {f['gemm']:.1f} "
                  f"({f['gemm'] / f['total']:.0%}), rest of delegates {f['delegates_other']:.1f}, "
                  f"outside {f['outside_delegates']:.1f}")
            top = list(f["operators_outside"].items())[:4]
            print("           outside: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
