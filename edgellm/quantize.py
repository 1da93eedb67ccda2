"""Weight quantization recipes, applied to the eager model before torch.export, through torchao.

A recipe is a torchao config handed to `quantize_`; nothing here quantizes by hand. The recipes
match ExecuTorch `export_llm`'s `qmode` of the same name (HQQ scale search, group size 128 unless
given, linears whose input width the group does not divide left in float), so an ExecuTorch YAML
config means the same thing here. 8da8w is per channel: XNNPACK has group-wise kernels for 4-bit
weights only (export_llm's 8da8w with its default group of 128 fails inside XNNPACK).
"""

from __future__ import annotations

from torch import nn

from .errors import InputError

DEFAULT_GROUP = 128
BITS = {"8da4w": 4, "8da8w": 8}  # weight bits per recipe (config.QUANTIZE names the backends)
# (minimum SQNR dB, minimum top-1 agreement) of a program with the recipe against the float
# model, checked by verify: the accuracy a recipe promises
ACCURACY_BOUNDS = {"8da4w": (10.0, 0.6), "8da8w": (20.0, 0.8)}


def quantize(model: nn.Module, recipe: str, group_size: int | None) -> int:
    """Quantize the model's nn.Linear weights in place; returns how many bytes a decode step
    reads fewer (float weights replaced by packed ones and one fp32 scale per group)."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    bits = BITS[recipe]
    default = DEFAULT_GROUP if bits == 4 else 0  # XNNPACK has group-wise kernels for 4 bits only
    group = default if group_size is None else group_size
    chosen = []

    def linear_fits(module, fqn):
        fits = isinstance(module, nn.Linear) and (group == 0 or module.in_features % group == 0)
        if fits:
            rows, cols = module.weight.shape
            groups = rows * (1 if group == 0 else cols // group)
            packed = rows * cols * bits // 8 + groups * 4
            chosen.append(module.weight.numel() * module.weight.element_size() - packed)
        return fits

    quantize_(model, Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if bits == 4 else torch.int8,
        weight_granularity=PerAxis(0) if group == 0 else PerGroup(group),
        intx_choose_qparams_algorithm="hqq_scale_only"), filter_fn=linear_fits)
    if not chosen:
        raise InputError(f"quantize: no linear layer's input width is a multiple of group_size "
                         f"{group}; choose a group size that divides the hidden size, or 0 for "
                         "per-channel")
    return sum(chosen)
