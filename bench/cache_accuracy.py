"""Programs against each other along the shipped text (edgellm/data/perplexity.txt), a token per
call as a runner feeds them: what an int8 KV cache costs against the fp32-cache program, beside
what any other change of rounding costs (two fp32-cache programs of the same weights and recipe
from two exporters).

usage: python bench/cache_accuracy.py NAME=A.pte NAME=B.pte [...] --tokenizer DIR
           [--pairs A:B,C:D]

Prints each program's perplexity along the text and, per pair (default: every pair), top-1
agreement and SQNR of the logits; the last line is one JSON object.
"""

import argparse
import itertools
import json
from pathlib import Path

import speed_vs_anchor  # noqa: F401  sets OMP_NUM_THREADS=1 before torch loads

import torch  # noqa: E402

from edgellm.numerics import compare  # noqa: E402
from edgellm.program import Program, native_logs  # noqa: E402
from edgellm.sources.base import load_tokenizer  # noqa: E402
from edgellm.verification import TEXT, perplexity  # noqa: E402


def along(program: Program, ids: list[int]) -> torch.Tensor:
    """Logits after each token of `ids` but the last, one call per token from position 0."""
    rows = []
    with native_logs(), torch.no_grad():
        for i, tok in enumerate(ids[:-1]):
            rows.append(program.forward(torch.tensor([[tok]]), torch.tensor([i]))[0])
    return torch.stack(rows).float()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("programs", nargs="+", metavar="NAME=PTE")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--pairs", help="NAME:NAME,... (default: every pair)")
    a = p.parse_args()
    ids = load_tokenizer(Path(a.tokenizer)).encode(TEXT.read_text()).ids
    logits = {n: along(Program(path), ids) for n, path in (x.split("=", 1) for x in a.programs)}
    pairs = ([tuple(x.split(":")) for x in a.pairs.split(",")] if a.pairs
             else list(itertools.combinations(logits, 2)))
    out = {"tokens": len(ids), "perplexity": {n: round(perplexity(x, ids), 3)
                                              for n, x in logits.items()}, "pairs": {}}
    print(f"{len(ids)} tokens of {TEXT.name}; perplexity: "
          + ", ".join(f"{n} {v}" for n, v in out["perplexity"].items()))
    print("| pair | top-1 agreement | SQNR dB |\n|---|---|---|")
    for x, y in pairs:
        c = compare(logits[x], logits[y])
        out["pairs"][f"{x}:{y}"] = {"top1": round(c.argmax_agree, 4),
                                    "sqnr_db": round(c.sqnr_db, 2)}
        print(f"| {x} vs {y} | {c.argmax_agree:.3f} | {c.sqnr_db:.1f} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
