"""Verification's quantized bounds on a real model (issue 42, item 7): for each program, its eager
model's sensitivity to its activations' rounding (`verification.activation_limits`: the eager
model with its activations unrounded, against itself) beside what the program reaches against
that eager model, and the bound that follows; then wrong programs, which must fail.

Correct programs: the embedded SmolLM2-135M and each GGUF given, with no recipe (the file's own
quantization), and with `--float F32.gguf` (bench/from_float.py writes one) the recipes of
FLOAT_RECIPES. Wrong programs: the embedded model's program checked against an eager model whose
middle layer's first norm is scaled by S (`--wrong S ...`; 0 drops that layer's attention
input), as a lowering that changed one layer's math would be. XNNPACK, `--max-seq-len 128`.

usage: python bench/gate_bounds.py OUTDIR [GGUF ...] [--float F32.gguf] [--wrong S ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

FLOAT_RECIPES = {  # name -> export options on a float file
    "8da4w g32 (the mix)": dict(quantize="8da4w", group_size=32, embedding_quantize="4,32"),
    "8da8w": dict(quantize="8da8w"),
    "8da4w g64 (torchao's)": dict(quantize="8da4w", group_size=64, embedding_quantize="4,32"),
}


def checked(model, dest: Path, wrong: float | None = None, **options) -> dict:
    """Export `model` (None: the embedded one) with verification; the program check's figures
    and its eager model's sensitivity (SQNR, top-1 of its logits with activations unrounded)."""
    import edgellm
    from edgellm import verification
    from edgellm.errors import VerificationError
    from edgellm.numerics import compare

    seen, limits_of, expect = [], verification.activation_limits, verification.Verification._expect

    def recorded(m, collect, clean):
        unrounded = []
        out = limits_of(m, lambda x: unrounded.append(collect(x)) or unrounded[-1], clean)
        if unrounded:
            seen.append(compare(torch.cat(unrounded[0]), torch.cat(clean)))
        return out

    def off(self, m):  # the eager side's middle layer's first norm scaled while it is measured
        layers = m.model.layers if hasattr(m, "model") else m.layers
        norm = next(p for n, p in layers[len(layers) // 2].named_parameters() if "norm" in n)
        kept = norm.detach().clone()
        with torch.no_grad():
            norm.mul_(wrong)
        try:
            return expect(self, m)
        finally:
            with torch.no_grad():
                norm.copy_(kept)

    verification.activation_limits = recorded
    if wrong is not None:
        verification.Verification._expect = off
    try:
        edgellm.export(*[model] * bool(model), output=str(dest), force=True, quiet=True,
                       backends="xnnpack", max_seq_len=128, **options)
    except VerificationError:
        pass  # the report says which check failed
    finally:
        verification.activation_limits, verification.Verification._expect = limits_of, expect
    report = json.loads((dest / "report.json").read_text())["verify"]
    program = next(c for c in report["checks"] if c["level"] == "program")
    sens = seen[0] if seen else None
    return dict(sensitivity=sens and round(sens.sqnr_db, 1),
                sensitivity_top1=sens and round(sens.argmax_agree, 3),
                sqnr=round(program["sqnr_db"], 1), top1=round(program["top1"], 3),
                bound=program["min_sqnr_db"], bound_top1=program["min_top1"],
                program="passed" if program["passed"] else "failed",
                export="verified" if report["passed"] else "failed")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("gguf", nargs="*")
    p.add_argument("--float", help="a float GGUF for FLOAT_RECIPES")
    p.add_argument("--wrong", type=float, nargs="*", default=[])
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [("embedded, no recipe", None, {})]
    cases += [(f"{Path(g).name}, no recipe", g, {}) for g in a.gguf]
    cases += [(f"float, {n}", a.float, o) for n, o in FLOAT_RECIPES.items() if a.float]
    cases += [(f"embedded, wrong: norm x{s:g}", None, dict(wrong=s)) for s in a.wrong]
    print("| program | sensitivity dB (top-1) | program SQNR dB (top-1) | bound dB (top-1) "
          "| program check | export |\n|---|---|---|---|---|---|")
    for i, (name, model, options) in enumerate(cases):
        r = checked(model, out / f"case{i}", **options)
        sens = "none (no activation rounded)" if r["sensitivity"] is None else \
            f"{r['sensitivity']} ({r['sensitivity_top1']})"
        print(f"| {name} | {sens} | {r['sqnr']} ({r['top1']}) | {r['bound']} ({r['bound_top1']}) "
              f"| {r['program']} | {r['export']} |", flush=True)


if __name__ == "__main__":
    main()
