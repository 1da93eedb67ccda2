"""What 8-bit offsets cost a kept grid: a GGUF's eager model as its default XNNPACK recipe builds it
(GridLinear offsets at 8 bits per output channel, dynamic 8-bit activations), then the same model
with each GridLinear's exact fp32 offsets put back, along the whole shipped text
(edgellm/data/perplexity.txt), or along two windows of 256 tokens of each `--text` file:
perplexity, and top-1 agreement with transformers in fp32 on the file's dequantized weights.

usage: python bench/grid_offsets.py [GGUF ...] [--text FILE ...]   (no GGUF: the embedded Q4_1)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import edgellm.quantize.grid as grid
from edgellm.backends import plan_for
from edgellm.config import resolve_config
from edgellm.eager import eager_model
from edgellm.progress import Stages
from edgellm.sources import load_source
from edgellm.verification import TEXT, sequence_logits, transformers_model

_INIT = grid.GridLinear.__init__


def _keeping_exact(self, linear, codes, offsets, sums):
    _INIT(self, linear, codes, offsets, sums)
    self.exact = offsets.clone()


WINDOW = 256


def texts(tokenizer, files: list[str]) -> list[list[int]]:
    """The shipped text whole, or two windows of WINDOW tokens from token 1000 of each file."""
    if not files:
        return [tokenizer.encode(TEXT.read_text()).ids]
    out = []
    for f in files:
        ids = tokenizer.encode(Path(f).read_text(errors="ignore")).ids
        out += [ids[i:i + WINDOW] for i in (1000, 1000 + WINDOW) if len(ids) >= i + WINDOW]
    return out


def measure(path: str | None, files: list[str]) -> None:
    grid.GridLinear.__init__ = _keeping_exact
    try:
        cfg = resolve_config(path, backends="xnnpack", max_seq_len=512)  # the text fits
        eager = eager_model(cfg, plan_for(cfg), Stages(quiet=True))
    finally:
        grid.GridLinear.__init__ = _INIT
    pieces = texts(eager.source.tokenizer(), files)
    reference_model = transformers_model(load_source(cfg.model))

    def row(what: str, run) -> None:
        nll, agree, count = 0.0, 0, 0
        with torch.no_grad():
            for ids in pieces:
                logits, reference = run(ids), reference_model(
                    torch.tensor([ids])).logits[0, :-1].float()
                nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]),
                                                               reduction="sum"))
                agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
                count += len(ids) - 1
        print(f"| {path or 'embedded Q4_1'} | {what} | {count} | {math.exp(nll / count):.3f} | "
              f"{agree / count:.3f} |", flush=True)

    row("transformers fp32",
        lambda ids: reference_model(torch.tensor([ids])).logits[0, :-1].float())
    row("offsets 8-bit (the default)", lambda ids: sequence_logits(eager.model, ids, 512)[:-1])
    for m in eager.model.modules():
        if isinstance(m, grid.GridLinear):
            m.offset.weight = torch.nn.Parameter(m.exact.float(), requires_grad=False)
    row("offsets fp32", lambda ids: sequence_logits(eager.model, ids, 512)[:-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="*")
    p.add_argument("--text", nargs="+", default=[], help="English text files (default: the "
                   "shipped perplexity.txt)")
    a = p.parse_args()
    print("| file | model | tokens | perplexity | top-1 vs fp32 |\n|---|---|---|---|---|")
    for path in a.gguf or [None]:
        measure(path, a.text)


if __name__ == "__main__":
    main()
