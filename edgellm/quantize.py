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

Weights that were already 4-bit in the source (a GGUF's Q4_0 / Q4_1 / Q4_K, whose blocks (Q4_K:
sub-blocks) of 32 hold at most 16 evenly spaced levels) are not quantized a second time by a
4-bit recipe: `8da4w` then defaults to group 32, and a linear whose every block lies on such a
grid becomes 4-bit codes on a symmetric grid (which torchao's `SYMMETRIC_NO_CLIPPING_ERR` scale
choice reproduces exactly) plus, where the grid is offset (Q4_1's and Q4_K's float minimum, which
integer zero points cannot hold), a float offset per block applied to the input's block sums
(`GridLinear`). Linears the GGUF keeps above 4 bits while it stores others at 4 (SmolLM2's Q8_0
tied head; a Q4_K_M file's Q5_0 / Q6_K tensors) get 8-bit weights under a 4-bit recipe: the
file's author spared them. `4w` (Core ML) keeps grids the same way, weight-only; Core ML's build
then leaves RMSNorm weights unfolded (folding one into a linear moves every block off the file's
grid) and q and k apart (`keeps_source_grids`, read by backends.Plan.model_options).
"""

from __future__ import annotations

import re
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
GRID_BLOCK = 32  # GGUF's Q4_0 and Q4_1 blocks, and Q4_K's sub-blocks
GRID_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# While linears are quantized, the checkpoint pages of those already done are dropped once this
# many float bytes have been (each drop reads /proc/self/smaps: per linear, 3 of LFM2.5-350M's
# 21 s stage)
DROP_PAGES_EVERY = 64 << 20
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


def stored_bits(kind: str | None) -> int | None:
    """Bits per weight of a GGUF storage type: 'Q4_1' -> 4, 'Q8_0' -> 8, 'F16' -> 16."""
    found = re.search(r"\d+", kind or "")
    return int(found.group()) if found else None


def block_grid(weight, block: int = GRID_BLOCK, tol: float = 1e-3):
    """(codes, offsets) when every block of `block` input columns of `weight` (out, in) holds at
    most 16 evenly spaced levels offset + step * k, k in -8..7: codes = weight - offset (out, in),
    offsets (out, in / block), zero where the grid runs through zero. Q4_1 blocks span their
    minimum to maximum in 15 steps; Q4_0 blocks step max|w| / 8 through zero; Q4_K's sub-blocks
    are Q4_1's with a searched scale, whose codes need not reach both ends: fewer steps. Else
    None."""
    import torch

    rows, cols = weight.shape
    if cols % block:
        return None
    b = weight.detach().float().view(rows, cols // block, block)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)

    def levels(step, origin):  # (rows, blocks) whether every value is origin + step * integer
        k = (b - origin) / torch.where(step > 0, step, torch.ones_like(step))
        return ((k - k.round()).abs() <= tol).all(-1), k

    step0 = torch.maximum(-lo, hi) / 8  # Q4_0-like: zero is a level, max|w| is level -8 or 8
    fits0, k0 = levels(step0, torch.zeros_like(lo))
    top = k0.amax(-1) > 7.5
    fits0 &= ~(top & (k0.amin(-1) < -7.5))  # -8..8 are 17 levels
    step1 = (hi - lo) / 15  # Q4_1-like: lo is level -8, hi level 7
    fits1, _ = levels(step1, lo)
    for span in range(14, 0, -1):  # Q4_K-like: lo to hi in fewer steps (a finer grid fits too)
        if bool((fits0 | fits1).all()):
            break
        fits, _ = levels((hi - lo) / span, lo)
        fits &= ~(fits0 | fits1)
        step1 = torch.where(fits[..., None], (hi - lo) / span, step1)
        fits1 |= fits
    if not bool((fits0 | fits1).all()):
        return None
    offsets = torch.where(fits0, torch.where(top, step0[..., 0], 0.0), (lo + 8 * step1)[..., 0])
    return (b - offsets[..., None]).view(rows, cols), offsets


@dataclass
class Quantized:
    """What quantize() did: report.json's `quantization`, and the bytes a decode step saves."""

    recipe: str | None
    group_size: int | None
    embeddings: str | None
    bytes_saved: int = 0  # per decode step
    linears_quantized: int = 0
    linears_left_float: list = field(default_factory=list)  # inputs the group does not divide
    linears_on_source_grid: int = 0  # 4-bit grids kept exactly (GGUF Q4_0 / Q4_1 / Q4_K)
    linears_at_8_bits: list = field(default_factory=list)  # the source stores them above 4 bits
    embeddings_stored_as: str | None = None  # the source's type that kept the table at 8 bits

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "bytes_saved"}

    def notes(self) -> list[str]:
        """Lines for stderr: linears left in float (a warning), grids kept, 8-bit exceptions."""
        out, left = [], self.linears_left_float
        if left:
            names = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
            out.append(f"[edgellm] quantize: {len(left)} of {len(left) + self.linears_quantized}"
                       f" linears stay in float: their input width is no multiple of group_size"
                       f" {self.group_size} ({names}); a smaller --group-size quantizes them")
        if self.linears_on_source_grid:
            out.append(f"[edgellm] quantize: {self.linears_on_source_grid} linears keep the "
                       f"source's 4-bit grid exactly (blocks of {self.group_size})")
        if self.embeddings_stored_as:
            out.append(f"[edgellm] quantize: embeddings in 8 bits ({self.embeddings}): the "
                       f"source stores the table as {self.embeddings_stored_as}")
        if self.linears_at_8_bits:
            eight = self.linears_at_8_bits
            many = "linears get" if len(eight) > 1 else "linear gets"
            out.append(f"[edgellm] quantize: {len(eight)} {many} 8-bit weights: the source "
                       f"stores them above 4 bits ({', '.join(eight[:3])}"
                       f"{', ...' if len(eight) > 3 else ''})")
        return out


def keeps_source_grids(cfg, stored: dict | None) -> bool:
    """Whether the recipe keeps a source's 4-bit grids: a 4-bit recipe at the file's block
    (group unset or 32) over a source storing Q4_0 / Q4_1 / Q4_K tensors (`stored`: name ->
    storage type). The one rule for both sides: quantize keeps the grids by it, and
    backends.Plan.model_options writes the model so that they survive."""
    recipe = RECIPES.get(cfg.quantize) if cfg.quantize else None
    return (recipe is not None and recipe.bits == 4 and cfg.group_size in (None, GRID_BLOCK)
            and any(t in GRID_TYPES for t in (stored or {}).values()))


def source_types(model, stored: dict) -> dict:
    """Linear module name -> the source's storage type of its weight, and "embedding" -> the
    table's; a tied head (no weight of its own in the source) takes the embedding's. A model that
    renamed parameters at load (LFM2's split in_proj) says whose they were by `source_name`."""
    from torch import nn

    names = {n: m for n, m in model.named_modules()}
    source = getattr(model, "source_name", lambda name: name)
    table = _embedding_name(model)
    embed = f"{table}.weight" if table is not None else None
    out = {n: stored.get(source(f"{n}.weight")) for n, m in names.items()
           if isinstance(m, nn.Linear)}
    if "lm_head" in out and out["lm_head"] is None:
        out["lm_head"] = stored.get(embed)
    out["embedding"] = stored.get(embed)
    return {n: t for n, t in out.items() if t is not None}


def _embedding_name(model) -> str | None:
    from torch import nn

    return next((n for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)


def _torchao(bits: int, group: int, dynamic: bool, algorithm: str = HQQ, exact: bool = False):
    """The torchao config of a recipe: `exact` keeps a symmetric grid whose step is
    max(-min / 8, max / 7) (SYMMETRIC_NO_CLIPPING_ERR), which HQQ's search would move."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    dtype, granularity = (torch.int4 if bits == 4 else torch.int8,
                          PerAxis(0) if group == 0 else PerGroup(group))
    mapping = MappingType.SYMMETRIC_NO_CLIPPING_ERR if exact else MappingType.SYMMETRIC
    if dynamic:
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=dtype, weight_granularity=granularity, weight_mapping_type=mapping,
            intx_choose_qparams_algorithm=algorithm)
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping,
                                intx_choose_qparams_algorithm=algorithm)


def _packed(weight, bits: int, group: int) -> int:
    rows, cols = weight.shape
    return rows * cols * bits // 8 + rows * (1 if group == 0 else cols // group) * 4


def _spared_tied_head(model, recipe, types: dict, four_bit: bool) -> bool:
    """Whether the head is the embedding table itself (tied, no linear of its own: Core ML's
    build) and gets the 8 bits a 4-bit recipe gives a head the source stored above 4 bits (as
    XNNPACK's separate head does): then the table is quantized to 8 bits, per row, with it."""
    return (getattr(model, "lm_head", None) is None and recipe is not None and recipe.bits == 4
            and four_bit and (stored_bits(types.get("embedding")) or 0) > 4)


def _quantize_embeddings(model, text: str, types: dict, four_bit: bool, done: Quantized) -> None:
    from torch import nn
    from torchao.quantization import quantize_

    from .errors import InputError

    bits, group = parse_embedding(text)
    if bits == 4 and four_bit and (stored_bits(types.get("embedding")) or 0) > 4:
        bits, group = 8, 0  # the source spared its table: 8 bits per row
        done.embeddings, done.embeddings_stored_as = "8,0", types["embedding"]
    tables = []

    def embedding_fits(module, fqn):
        if not isinstance(module, nn.Embedding):
            return False
        tables.append(group == 0 or module.embedding_dim % group == 0)
        return tables[-1]

    quantize_(model, _torchao(bits, group, dynamic=False, algorithm="affine"),
              filter_fn=embedding_fits)
    if not any(tables):
        raise InputError(f"embedding_quantize: group {group} does not divide the embedding "
                         "width; choose a group that divides the hidden size, or 0 per row")


def _keep_grids(model, types: dict, dynamic: bool, done: Quantized) -> list[int]:
    """Replace every linear the source stored as Q4_0 / Q4_1 / Q4_K and whose blocks lie on a
    grid by its exact 4-bit form (a GridLinear where the grid is offset); returns the bytes each
    saves."""
    import torch
    from torch import nn
    from torchao.quantization import quantize_

    from .architectures.layers import GridLinear

    exact, saved, sums = _torchao(4, GRID_BLOCK, dynamic, "affine", exact=True), [], {}
    for fqn, module in list(model.named_modules()):
        if types.get(fqn) not in GRID_TYPES or not isinstance(module, nn.Linear):
            continue
        found = block_grid(module.weight)
        offset = found is not None and bool(found[1].any())
        if found is None or offset and fqn == "lm_head":  # the head is applied as a weight
            continue
        codes, offsets = found
        size = module.weight.element_size()
        saved.append(module.weight.numel() * size - _packed(codes, 4, GRID_BLOCK)
                     - (offsets.numel() * size if offset else 0))
        if offset:
            width = codes.shape[1]
            if width not in sums:
                eye = torch.eye(width // GRID_BLOCK).repeat_interleave(GRID_BLOCK, dim=1)
                sums[width] = nn.Parameter(eye.to(module.weight.dtype), requires_grad=False)
            parent, _, name = fqn.rpartition(".")
            module = GridLinear(module, codes, offsets, sums[width])
            setattr(model.get_submodule(parent), name, module)
            module = module.linear
        quantize_(module, exact, filter_fn=lambda m, f: isinstance(m, nn.Linear))
        done.linears_on_source_grid += 1
    return saved


def quantize(model, cfg, stored: dict | None = None) -> Quantized:
    """Quantize the model's nn.Linear weights (cfg.quantize) and nn.Embedding tables
    (cfg.embedding_quantize) in place; `stored` maps HF parameter names to the source's storage
    types (GGUF), whose 4-bit grids and 8-bit choices a 4-bit recipe keeps. Returns how many
    bytes a decode step reads fewer (float weights replaced by packed ones and one fp32 scale per
    group; an embedding step reads one row either way) and what happened to each linear."""
    from torch import nn
    from torchao.quantization import quantize_

    from .architectures.layers import GridLinear
    from .errors import InputError
    from .progress import drop_checkpoint_pages

    types = source_types(model, stored or {})
    linear_types = {n: t for n, t in types.items() if n != "embedding"}
    four_bit = any((stored_bits(t) or 99) <= 4 for t in linear_types.values())
    done = Quantized(cfg.quantize, None, cfg.embedding_quantize)
    recipe = RECIPES[cfg.quantize] if cfg.quantize else None
    head_in_table = 0  # float bytes of a tied head's table, which decode reads whole
    if not cfg.embedding_quantize and _spared_tied_head(model, recipe, types, four_bit):
        table = model.get_submodule(_embedding_name(model)).weight
        head_in_table = table.numel() * table.element_size() - _packed(table, 8, 0)
        done.embeddings, done.embeddings_stored_as = "8", types["embedding"]
        done.linears_at_8_bits.append("lm_head")
        _quantize_embeddings(model, "8", types, four_bit, done)
    if cfg.embedding_quantize:
        _quantize_embeddings(model, cfg.embedding_quantize, types, four_bit, done)
    if recipe is None:
        return done
    four_bit &= recipe.bits == 4
    grids = keeps_source_grids(cfg, linear_types)  # the rule the build writes the model by
    group = done.group_size = GRID_BLOCK if grids else group_of(cfg)
    saved = _keep_grids(model, types, recipe.dynamic, done) if grids else []
    grid_parts = {f"{n}.{part}" for n, m in model.named_modules() if isinstance(m, GridLinear)
                  for part in ("sums", "offset")}  # float by design

    pending = 0  # float bytes quantized since checkpoint pages were last dropped

    def choose(bits, at_least=0):
        def fits(module, fqn):
            nonlocal pending
            if (not isinstance(module, nn.Linear) or fqn in grid_parts
                    or hasattr(module.weight, "qdata")  # a kept grid, already quantized
                    or module.weight.numel() < at_least):
                return False
            higher = four_bit and (stored_bits(types.get(fqn)) or 0) > 4
            if higher != (bits == 8 and recipe.bits == 4):
                return False
            g = 0 if higher else group
            if g and module.in_features % g:
                if not at_least:  # named once, in module order, by the pass over all
                    done.linears_left_float.append(fqn)
                return False
            saved.append(module.weight.numel() * module.weight.element_size()
                         - _packed(module.weight, bits, g))
            pending += module.weight.nbytes
            if pending >= DROP_PAGES_EVERY:  # those of the linears quantized before this one
                drop_checkpoint_pages()
                pending = 0
            if higher:
                done.linears_at_8_bits.append(fqn)
            return True
        return fits

    # The largest linears (the head) first: HQQ holds several float copies of a weight while it
    # works, and this way they come while little else is held (LFM2.5-350M 8da4w: the quantize
    # stage's peak 1888 -> 1506 MB). Each weight is quantized on its own: the order changes nothing.
    largest = max((m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)),
                  default=0)
    for at_least in (largest, 0):
        if four_bit:  # linears the source keeps above 4 bits: 8-bit per channel
            quantize_(model, _torchao(8, 0, recipe.dynamic), filter_fn=choose(8, at_least))
        quantize_(model, _torchao(recipe.bits, group, recipe.dynamic),
                  filter_fn=choose(recipe.bits, at_least))
    if not saved:
        raise InputError(f"quantize: no linear layer's input width is a multiple of group_size "
                         f"{group}; choose a group size that divides the hidden size, or 0 for "
                         "per-channel")
    done.bytes_saved, done.linears_quantized = sum(saved) + head_in_table, len(saved)
    return done
