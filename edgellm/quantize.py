"""Weight quantization recipes, applied to the eager model before torch.export, through torchao.

A recipe is a torchao config handed to `quantize_`; nothing here quantizes by hand. Linear recipes:

- `8da4w`, `8da8w` (XNNPACK): 8-bit dynamic per-token activations, 4- or 8-bit weights
  (`Int8DynamicActivationIntxWeightConfig`, HQQ scale search, like ExecuTorch `export_llm`'s
  `qmode` of the same name). 4-bit is group-wise (128 unless given) or per channel (group 0);
  8-bit is per channel: XNNPACK has group-wise kernels for 4-bit weights only.
- `4w`, `8w` (Core ML): weight-only (`IntxWeightOnlyConfig`, HQQ scales too); Core ML stores them as
  `constexpr_blockwise_shift_scale` (iOS 18) or `constexpr_affine_dequantize` (8-bit per channel,
  iOS 17). 4-bit defaults to blocks of 32 (export_llm's `b4w`); group 0 is per channel (`c4w`).
  XNNPACK is refused: ExecuTorch 1.5.1's partitioner delegates a torchao weight-only linear but
  the delegate multiplies by the unscaled integers (wrong logits, no error).

Embeddings (`embedding_quantize: "BITS[,GROUP]"`, export_llm's syntax): weight-only 8- or 4-bit
tables; on XNNPACK and portable ExecuTorch's quant fusion turns them into
`quantized_decomposed::embedding_byte` / `embedding_4bit`, on Core ML a gather from a constexpr.
Linears whose input width the group does not divide stay in float (as in export_llm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Recipe:
    bits: int
    dynamic: bool  # 8-bit dynamic activations (else weight-only)
    default_group: int  # 0: per channel
    backends: tuple[str, ...]  # backends with kernels for it
    bounds: tuple[float, float]  # (min SQNR dB, min top-1) against the float model: verify checks


RECIPES = {
    "8da4w": Recipe(4, True, 128, ("xnnpack",), (10.0, 0.6)),
    "8da8w": Recipe(8, True, 0, ("xnnpack",), (20.0, 0.8)),
    "4w": Recipe(4, False, 32, ("coreml",), (10.0, 0.6)),
    "8w": Recipe(8, False, 0, ("coreml",), (20.0, 0.8)),
}
# weight-only linears reaching XNNPACK anywhere in a chain come out wrong, hence refused
WRONG_ON_XNNPACK = ("ExecuTorch 1.5.1's XNNPACK delegate takes torchao weight-only linears but "
                    "multiplies by the unscaled integers (wrong logits, no error)")
NO_KERNELS = {("4w", "xnnpack"): f"{WRONG_ON_XNNPACK}; use 8da4w on xnnpack",
              ("8w", "xnnpack"): f"{WRONG_ON_XNNPACK}; use 8da8w on xnnpack"}
HQQ = "hqq_scale_only"  # every recipe's scale search, as export_llm's (its `use_hqq: true`)
EMBEDDING_BACKENDS = ("xnnpack", "portable", "coreml")
EMBEDDING_DEFAULT_GROUP = {8: 0, 4: 32}
# bounds of an embedding recipe alone, and the margin a combined recipe loses
EMBEDDING_BOUNDS = {8: (30.0, 0.9), 4: (15.0, 0.7)}


def parse_embedding(text) -> tuple[int, int]:
    """'8' | '4' | 'BITS,GROUP' -> (bits, group); raises ValueError naming what is allowed."""
    parts = str(text).replace(" ", "").split(",")
    try:
        bits = int(parts[0])
        group = int(parts[1]) if len(parts) == 2 else EMBEDDING_DEFAULT_GROUP.get(bits, 0)
    except (ValueError, IndexError):
        bits, group = None, None
    if len(parts) > 2 or bits not in EMBEDDING_DEFAULT_GROUP or group is None or group < 0:
        raise ValueError(f"embedding_quantize: {text!r} is not BITS[,GROUP] with BITS 8 or 4 and "
                         "GROUP >= 0 (0: per row), e.g. '8' or '4,32'")
    return bits, group


def group_of(cfg) -> int:
    return RECIPES[cfg.quantize].default_group if cfg.group_size is None else cfg.group_size


def problems(cfg) -> list[str]:
    """Recipe choices no backend can honour, each with the reason (config validation)."""
    out = []
    first = cfg.backends[0] if cfg.backends else None
    recipe = RECIPES.get(cfg.quantize) if cfg.quantize else None
    if cfg.quantize is not None and recipe is None:
        out.append(f"quantize: '{cfg.quantize}' is not one of {', '.join(RECIPES)}")
    elif recipe and (first not in recipe.backends or not recipe.dynamic and
                     "xnnpack" in cfg.backends):
        where = first if first not in recipe.backends else "xnnpack (in the chain)"
        why = NO_KERNELS.get((cfg.quantize, where.split()[0]), f"{where} has no kernels for it")
        out.append(f"quantize: {cfg.quantize} on {where}: {why}. Recipes per backend: "
                   + "; ".join(f"{b}: {', '.join(r for r in RECIPES if b in RECIPES[r].backends)}"
                               for b in ("xnnpack", "coreml")))
    if cfg.group_size is not None and cfg.quantize is None:
        out.append(f"group_size: {cfg.group_size} is set but quantize is not; set quantize "
                   f"(one of {', '.join(RECIPES)}) or drop group_size")
    if isinstance(cfg.group_size, int) and cfg.group_size < 0:
        out.append(f"group_size: {cfg.group_size} is negative; use 0 for per-channel")
    elif cfg.quantize == "8da8w" and isinstance(cfg.group_size, int) and cfg.group_size > 0:
        out.append(f"group_size: {cfg.group_size} with 8da8w; XNNPACK quantizes 8-bit weights "
                   "per channel only (group-wise kernels exist for 4-bit): use group_size 0 or "
                   "leave it unset")
    if cfg.embedding_quantize is not None:
        try:
            parse_embedding(cfg.embedding_quantize)
        except ValueError as e:
            out.append(str(e))
        else:
            if first not in EMBEDDING_BACKENDS:
                out.append(f"embedding_quantize: {first} has no quantized embedding kernels; "
                           f"use one of {', '.join(EMBEDDING_BACKENDS)} or drop it")
    return out


def coreml_problems(cfg, min_ios: int) -> list[str]:
    """Core ML stores 4-bit and block-wise weights from iOS 18 (constexpr_blockwise_shift_scale);
    below it only 8-bit per channel (constexpr_affine_dequantize)."""
    out = []
    if min_ios >= 18:
        return out
    if cfg.quantize in RECIPES and (RECIPES[cfg.quantize].bits == 4 or group_of(cfg) > 0):
        out.append(f"quantize: {cfg.quantize} with group_size {group_of(cfg)} needs "
                   f"coreml.min_ios 18 (4-bit and block-wise weights arrive in iOS 18), not "
                   f"{min_ios}; set coreml.min_ios=18 or use 8w per channel (group_size 0)")
    if cfg.embedding_quantize is not None:
        try:
            bits, group = parse_embedding(cfg.embedding_quantize)
        except ValueError:
            return out
        if bits == 4 or group > 0:
            out.append(f"embedding_quantize: {cfg.embedding_quantize!r} needs coreml.min_ios 18 "
                       f"(4-bit and block-wise weights arrive in iOS 18), not {min_ios}; set "
                       "coreml.min_ios=18 or use '8,0'")
    return out


def accuracy_bounds(cfg) -> tuple[float, float]:
    """(min SQNR dB, min top-1) the quantized program must reach against the float model: the
    looser of the linear and embedding recipes' bounds, 3 dB and 0.05 looser when both apply."""
    bounds = []
    if cfg.quantize:
        bounds.append(RECIPES[cfg.quantize].bounds)
    if cfg.embedding_quantize:
        bounds.append(EMBEDDING_BOUNDS[parse_embedding(cfg.embedding_quantize)[0]])
    sqnr, top1 = min(b[0] for b in bounds), min(b[1] for b in bounds)
    return (sqnr - 3.0, round(top1 - 0.05, 2)) if len(bounds) > 1 else (sqnr, top1)


@dataclass
class Quantized:
    """What quantize() did: report.json's `quantization`, and the bytes a decode step saves."""

    recipe: str | None
    group_size: int | None
    embeddings: str | None
    bytes_saved: int = 0  # per decode step
    linears_quantized: int = 0
    linears_left_float: list = field(default_factory=list)  # inputs the group does not divide

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "bytes_saved"}

    def warning(self) -> str | None:
        """One line naming the linears left in float, or None."""
        left = self.linears_left_float
        if not left:
            return None
        names = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
        return (f"[edgellm] quantize: {len(left)} of {len(left) + self.linears_quantized} "
                f"linears stay in float: their input width is no multiple of group_size "
                f"{self.group_size} ({names}); a smaller --group-size quantizes them")


def quantize(model, cfg) -> Quantized:
    """Quantize the model's nn.Linear weights (cfg.quantize) and nn.Embedding tables
    (cfg.embedding_quantize) in place; returns how many bytes a decode step reads fewer (float
    weights replaced by packed ones and one fp32 scale per group; an embedding step reads one
    row either way), how many linears were quantized and which were left in float."""
    import torch
    from torch import nn
    from torchao.quantization import (Int8DynamicActivationIntxWeightConfig,
                                      IntxWeightOnlyConfig, quantize_)
    from torchao.quantization.granularity import PerAxis, PerGroup

    from .errors import InputError

    def granularity(group):
        return PerAxis(0) if group == 0 else PerGroup(group)

    def dtype(bits):
        return torch.int4 if bits == 4 else torch.int8

    if cfg.embedding_quantize:
        bits, group = parse_embedding(cfg.embedding_quantize)
        tables = []

        def embedding_fits(module, fqn):
            if not isinstance(module, nn.Embedding):
                return False
            tables.append(group == 0 or module.embedding_dim % group == 0)
            return tables[-1]

        quantize_(model, IntxWeightOnlyConfig(weight_dtype=dtype(bits),
                                              granularity=granularity(group)),
                  filter_fn=embedding_fits)
        if not any(tables):
            raise InputError(f"embedding_quantize: group {group} does not divide the embedding "
                             "width; choose a group that divides the hidden size, or 0 per row")
    if not cfg.quantize:
        return Quantized(None, None, cfg.embedding_quantize)
    recipe, group = RECIPES[cfg.quantize], group_of(cfg)
    saved, skipped = [], []

    def linear_fits(module, fqn):
        fits = isinstance(module, nn.Linear) and (group == 0 or module.in_features % group == 0)
        if isinstance(module, nn.Linear) and not fits:
            skipped.append(fqn)
        if fits:
            rows, cols = module.weight.shape
            groups = rows * (1 if group == 0 else cols // group)
            packed = rows * cols * recipe.bits // 8 + groups * 4
            saved.append(module.weight.numel() * module.weight.element_size() - packed)
        return fits

    if recipe.dynamic:
        config = Int8DynamicActivationIntxWeightConfig(
            weight_dtype=dtype(recipe.bits), weight_granularity=granularity(group),
            intx_choose_qparams_algorithm=HQQ)
    else:
        config = IntxWeightOnlyConfig(weight_dtype=dtype(recipe.bits),
                                      granularity=granularity(group),
                                      intx_choose_qparams_algorithm=HQQ)
    quantize_(model, config, filter_fn=linear_fits)
    if not saved:
        raise InputError(f"quantize: no linear layer's input width is a multiple of group_size "
                         f"{group}; choose a group size that divides the hidden size, or 0 for "
                         "per-channel")
    return Quantized(cfg.quantize, group, cfg.embedding_quantize, sum(saved), len(saved), skipped)
