"""Weight quantization, applied to the eager model before torch.export, through torchao.

- `recipes.py`: what each recipe is (a torchao config), its accuracy bounds, and what a chain of
  backends cannot honour;
- `plan.py`: the bits and group of every linear and table, decided from the recipe and from what
  the source stored (a GGUF's 4-bit grids and the tensors it spared at higher precision);
- `grid.py`: a source's 4-bit grids found in its weights and kept exactly (`GridLinear`);
- `apply.py`: the plan applied with torchao's `quantize_`, and what was done (`Quantized`);
- `experts.py`: mixture-of-experts weights packed for ExecuTorch's `llama::quantized_moe_ffn`.

Linears and tables are quantized by torchao alone, and the lowering path does not change:
ExecuTorch's backends take torchao's quantized linears and embeddings as they are. Experts are
quantized with torchao's primitives and packed in torchao's layout by hand (experts.py says
why). Importing this package (or recipes.py) does not import torch.
"""

from __future__ import annotations

from .recipes import RECIPES, Recipe, accuracy_bounds, group_of, parse_embedding, problems

__all__ = ["RECIPES", "Recipe", "accuracy_bounds", "group_of", "parse_embedding", "problems",
           "quantize"]


def quantize(model, cfg, stored: dict | None = None, experts_refused: str | None = None):
    """Quantize `model` in place as cfg asks (apply.quantize); returns what was done."""
    from .apply import quantize as run

    return run(model, cfg, stored, experts_refused)
