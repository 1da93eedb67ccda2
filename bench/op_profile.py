"""Where a program's prefill and decode time goes, per operator, from ExecuTorch's own profiler.

    python bench/op_profile.py PTE [PTE ...] [--prompt-len 64] [--steps 64]

Each program is loaded with ETDump profiling on (ExecuTorch's wheel records every operator call
and, inside the XNNPACK delegate, every XNNPACK operator), then runs a prompt three times from
position 0 and `--steps` single-token calls after it. Printed per program: prefill (the fastest of
the last two prompt runs) and decode (the mean per token) in microseconds, split into XNNPACK's
GEMMs (fully connected), other XNNPACK work, and each operator outside the delegates. Profiling
adds a few microseconds per event, so totals read a little above `edgellm bench`. The last line
is one JSON object with every figure.

The GEMMs' share says what a faster program could still win: decode that is nearly all GEMM is
bound by XNNPACK's kernels (and so by memory bandwidth), whatever the graph around them. It runs
with OMP_NUM_THREADS=1 unless set (edgellm/openmp.py: `llama::custom_sdpa`'s BLAS otherwise starts
OpenMP teams that contend with XNNPACK's threadpool in this Python process).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

from edgellm.openmp import one_thread_per_team

one_thread_per_team()  # before torch is imported


def profile(pte: Path, prompt_len: int, steps: int) -> dict:
    import torch

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama:: kernels
    import executorch.kernels.quantized  # noqa: F401  quantized embeddings
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    module = portable_lib._load_for_executorch(str(pte), enable_etdump=True, debug_buffer_size=0)
    ids = torch.randint(0, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the first run also plans and packs: not counted
        module.run_method("forward", (ids, torch.tensor([0])))
    for i in range(steps):
        module.run_method("forward", (torch.tensor([[1]]), torch.tensor([prompt_len + i])))
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "etdump.etdp"
        module.write_etdump_result_to_file(str(dump))
        events = [e for block in Inspector(etdump_path=str(dump)).event_blocks
                  if block.name == "Execute" for e in block.events if e.perf_data is not None]
    prefill, decode = collections.Counter(), collections.Counter()
    for event in events:
        raw = event.perf_data.raw  # ms, one per run of the method
        if len(raw) != 3 + steps:  # an event of some runs only (none expected)
            continue
        name = re.sub(r" #\d+$", "", event.name)
        prefill[name] += min(raw[1:3]) * 1000
        decode[name] += sum(raw[3:]) / steps * 1000
    return {"prefill_us": split(prefill), "decode_us": split(decode)}


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
