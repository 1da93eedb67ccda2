"""What a 4-bit recipe does to a GGUF's tensors on no 4-bit grid (Q5_0, Q5_1, Q5_K, IQ4_NL,
IQ4_XS, 2- and 3-bit types; quantize.plan.off_grid), measured instead of assumed: transformers on
the file's dequantized weights, with those tensors (the head apart, as the plan does) replaced by

- `symmetric`: torchao's 4-bit symmetric grid in groups of 32 with HQQ's scale search (what a
  4-bit recipe gives a tensor it knows nothing about),
- `Q4_1`: the gguf package's Q4_1 quantizer, a step and a minimum per block of 32
  (grid.onto_q4_1: what edgellm does),

each along the whole shipped text (edgellm/data/perplexity.txt) with float activations and with
every linear's input rounded as XNNPACK's dynamic 8-bit activations round it (one scale per
token): perplexity, and top-1 agreement with the file's own weights. Then the same two grids on
synthetic weights (Gaussian, Laplace, Student-t with 3 degrees of freedom; 576 x 1536) straight
from float and from Q5_0: SQNR against the float weights, which says whether a file's history
(SmolLM2's files are requantized from a Q4_1) decides the ranking.

usage: python bench/regrid.py GGUF [GGUF ...]      (prints a table row per file and grid)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import nn

from edgellm.quantize.grid import GRID_BLOCK, onto_q4_1, through_gguf
from edgellm.quantize.plan import off_grid
from edgellm.quantize.recipes import torchao_config
from edgellm.sources.gguf import load_gguf
from edgellm.verification import TEXT, transformers_model


def symmetric(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import quantize_

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    quantize_(linear, torchao_config(4, GRID_BLOCK, dynamic=False))
    return linear.weight.dequantize().detach()


GRIDS = {"file": lambda w: w, "symmetric": symmetric, "Q4_1": onto_q4_1}


def per_token_8bit(module, inputs):
    x = inputs[0]
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return ((x / scale).round().clamp(-128, 127) * scale,)


def logits_along(model, ids: list[int], activations: bool) -> torch.Tensor:
    hooks = [m.register_forward_pre_hook(per_token_8bit) for m in model.modules()
             if isinstance(m, nn.Linear)] if activations else []
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, :-1].float()
    finally:
        for hook in hooks:
            hook.remove()


def on_file(path: Path) -> None:
    source = load_gguf(path)
    ids = source.tokenizer().encode(TEXT.read_text()).ids
    model = transformers_model(source)
    names = [n for n, kind in source.stored_types.items()
             if off_grid(kind) and n.endswith(".weight") and "embed" not in n
             and not n.startswith("lm_head") and model.get_parameter(n).ndim == 2]
    kinds = sorted({source.stored_types[n] for n in names})
    originals = {n: model.get_parameter(n).detach().clone() for n in names}
    reference = None
    for grid, make in GRIDS.items():
        for name in names:
            model.get_parameter(name).data.copy_(make(originals[name]))
        for activations in (False, True):
            logits = logits_along(model, ids, activations)
            reference = logits if reference is None else reference
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
            top1 = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
            print(f"| {path.name} | {len(names)} {'/'.join(kinds)} | {grid} | "
                  f"{'8-bit per token' if activations else 'float'} | {math.exp(nll):.3f} | "
                  f"{top1:.3f} |", flush=True)


def synthetic() -> None:
    def sqnr(a, b):
        return float(10 * torch.log10(b.square().sum() / (a - b).square().sum()))

    torch.manual_seed(0)  # torch.distributions samples from the global generator
    g = torch.Generator().manual_seed(0)
    shape = (576, 1536)
    for name, w in [("Gaussian", torch.randn(shape, generator=g)),
                    ("Laplace", torch.distributions.Laplace(0.0, 1.0).sample(shape)),
                    ("Student-t, 3", torch.distributions.StudentT(3.0).sample(shape))]:
        start = through_gguf(w.float(), "Q5_0")
        print(f"| {name} | " + " | ".join(f"{sqnr(GRIDS[g](x), w):.2f}" for x in (w, start)
                                         for g in ("symmetric", "Q4_1")) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="+")
    a = p.parse_args()
    print("| file | tensors on no 4-bit grid | their grid | activations | perplexity | "
          "top-1 vs file |")
    print("|---|---|---|---|---|---|")
    for path in a.gguf:
        on_file(Path(path))
    print("\n| weights | symmetric from float | Q4_1 from float | symmetric from Q5_0 | "
          "Q4_1 from Q5_0 |  (SQNR dB against the float weights)")
    print("|---|---|---|---|---|")
    synthetic()


if __name__ == "__main__":
    sys.exit(main())
