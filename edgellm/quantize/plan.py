"""What quantization will do, decided before any weight changes: the bits and group of every linear
and of the embedding tables, from the recipe and from what the source stored.

A source that is already 4-bit (a GGUF's Q4_0 / Q4_1 / Q4_K tensors) is not quantized twice: a
4-bit recipe at the file's block keeps its grids (grid.py), and tensors the file keeps at
recipes.SPARED_BITS or more while its linears are 4-bit (SmolLM2's Q8_0 tied head and table, a
Q4_K_M file's Q6_K tensors) get 8 bits per channel: the file's author spared them. Its tensors
on no 4-bit grid (the Q5_0 / Q5_1 llama.cpp writes where a row is not a multiple of 256, in place
of its 4-bit K type; 3-bit and IQ types) take the recipe's 4 bits at the file's block, on Q4_1's
grid (grid.onto_q4_1). A head that is the embedding table itself (tied, no
linear of its own: Core ML's build) takes the table's bits.

A source the file did not make 4-bit (float weights, an F16 GGUF, a Q8_0 one) under a 4-bit
recipe at llama.cpp's block of 32 is quantized as llama.cpp's 4-bit mixes (Q4_K_M) are: every
linear on Q4_1's grid, except those that lose most per weight, which take 8 bits per channel
(`more_bits`): the head, every attention value projection and the FFN down projections of
llama.cpp's `use_more_bits` layers (BENCHMARKS.md, 4-bit from float weights, measures each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..errors import InputError
from .grid import GRID_BLOCK, GRID_TYPES
from .recipes import RECIPES, SPARED_BITS, group_of, parse_embedding, stored_bits


@dataclass
class Plan:
    recipe: str | None
    group: int | None = None  # the linears' group (0: per channel), None without a recipe
    dynamic: bool = False  # 8-bit dynamic activations
    linears: dict = field(default_factory=dict)  # name -> (bits, group), in module order
    grids: list = field(default_factory=list)  # kept on the source's grid where they lie on one
    regrid: list = field(default_factory=list)  # stored on no 4-bit grid: put on Q4_1's
    left_float: list = field(default_factory=list)  # the group does not divide their input
    at_8_bits: list = field(default_factory=list)  # the source stores them above 4 bits
    more_bits: list = field(default_factory=list)  # 8 bits where a 4-bit grid loses most
    embedding: tuple | None = None  # (bits, group) of the tables
    embeddings: str | None = None  # the table recipe as given, or as the source made it
    embeddings_stored_as: str | None = None  # the source's type that kept the table at 8 bits
    head_in_table: bool = False  # the head is the table: decode reads all of it
    # the table takes its tied head's 8-bit codes, so that a data file (--external-weights),
    # which keeps one buffer per content, stores them once
    table_from_head: bool = False
    experts: tuple | None = None  # (bits, group, "op", "chosen" or "every") of sparse blocks
    source_types: dict = field(default_factory=dict)  # linear name (or "embedding") -> type


def keeps_source_grids(cfg, stored: dict | None) -> bool:
    """Whether the recipe keeps a source's 4-bit grids: a 4-bit recipe at the file's block
    (group unset or 32) over a source storing Q4_0 / Q4_1 / Q4_K tensors (`stored`: name ->
    storage type). The one rule for both sides: the plan keeps the grids by it, and
    backends.Plan.model_options writes the model so that they survive."""
    recipe = RECIPES.get(cfg.quantize) if cfg.quantize else None
    return (recipe is not None and recipe.bits == 4 and cfg.group_size in (None, GRID_BLOCK)
            and any(t in GRID_TYPES for t in (stored or {}).values()))


def writes_linears_apart(cfg, stored: dict | None) -> bool:
    """Whether the model must be written with norms unfolded and q and k apart: where the recipe
    keeps a source's grids (keeps_source_grids), or quantizes float weights as llama.cpp's mixes
    (mixes), whose blocks a folded norm weight would stretch column by column (on SmolLM2, Core
    ML's mix fell from 13.5 to 6.9 dB with norms folded)."""
    recipe = RECIPES.get(cfg.quantize) if cfg.quantize else None
    four_bit = any((stored_bits(t) or 99) <= 4 for t in (stored or {}).values())
    return keeps_source_grids(cfg, stored) or mixes(recipe, recipe and group_of(cfg), four_bit)


def off_grid(kind: str | None) -> bool:
    """Whether a source's storage type holds 4 bits or fewer on no grid a 4-bit recipe keeps
    (Q5_0, Q5_1, Q5_K, Q3_K, IQ3_S, ...; SPARED_BITS and above, and IQ4, are spared instead)."""
    bits = stored_bits(kind)
    return bits is not None and bits < SPARED_BITS and kind not in GRID_TYPES


def source_types(model, stored: dict) -> dict:
    """Linear module name -> the source's storage type of its weight, and "embedding" -> the
    table's; a tied head (no weight of its own in the source) takes the embedding's. A model that
    renamed parameters at load (LFM2's split in_proj) says whose they were by `source_name`."""
    source = getattr(model, "source_name", lambda name: name)
    table = embedding_name(model)
    embed = f"{table}.weight" if table is not None else None
    out = {n: stored.get(source(f"{n}.weight")) for n, m in model.named_modules()
           if isinstance(m, nn.Linear)}
    if "lm_head" in out and out["lm_head"] is None:
        out["lm_head"] = stored.get(embed)
    out["embedding"] = stored.get(embed)
    return {n: t for n, t in out.items() if t is not None}


def mixes(recipe, group: int | None, four_bit: bool) -> bool:
    """Whether the plan chooses each linear's bits as llama.cpp's 4-bit mixes do: a 4-bit recipe
    at their block of 32 over a source that made no linear 4-bit itself."""
    return recipe is not None and recipe.bits == 4 and group == GRID_BLOCK and not four_bit


def more_bits(linears) -> set:
    """The linears of `linears` ((name, module)) a 4-bit mix gives 8 bits: the head, every
    attention value projection, and the FFN down projections of llama.cpp's `use_more_bits`
    layers (the first and last eighth, and every third between), as the `gguf` package's tensor
    name map names them (`MODEL_TENSOR.ATTN_V`, `FFN_DOWN`) in any family it knows."""
    import re

    from gguf import MODEL_TENSOR, TensorNameMap

    def of(kind) -> dict:  # name -> block number, under any prefix
        names = TensorNameMap.block_mappings_cfg[kind]
        found = re.compile("|".join(r"(?:.*\.)?" + re.escape(p).replace(r"\{bid\}", r"(\d+)")
                                    for p in names))
        return {name: int(next(g for g in m.groups() if g is not None))
                for name, _ in linears if (m := found.fullmatch(name))}

    downs = of(MODEL_TENSOR.FFN_DOWN)
    n = len(downs)
    spare = {name for name, i in downs.items()
             if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2}
    return spare | set(of(MODEL_TENSOR.ATTN_V)) | {name for name, _ in linears if name == "lm_head"}


def embedding_name(model) -> str | None:
    return next((n for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)


def plan(model, cfg, stored: dict | None = None, experts_refused: str | None = None) -> Plan:
    """The plan for `model` under cfg.quantize / cfg.embedding_quantize; `stored` maps HF
    parameter names to the source's storage types (GGUF); `experts_refused`: "<backend>: why"
    the backend writing the model takes no quantized experts. Raises InputError when the recipe
    would quantize nothing."""
    types = source_types(model, stored or {})
    four_bit = any((stored_bits(t) or 99) <= 4 for n, t in types.items() if n != "embedding")
    recipe = RECIPES[cfg.quantize] if cfg.quantize else None
    out = Plan(cfg.quantize, embeddings=cfg.embedding_quantize, source_types=types)
    _plan_tables(out, model, cfg, recipe, types, four_bit,
                 mixes(recipe, group_of(cfg) if recipe else None, four_bit))
    if recipe is None:
        return out
    four_bit &= recipe.bits == 4
    grids = keeps_source_grids(cfg, {n: t for n, t in types.items() if n != "embedding"})
    out.group, out.dynamic = GRID_BLOCK if grids else group_of(cfg), recipe.dynamic
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    largest = max((m.weight.numel() for _, m in linears), default=0)
    mix = more_bits(linears) if mixes(recipe, out.group, four_bit) else None
    higher = []
    for name, module in linears:
        spared = four_bit and (stored_bits(types.get(name)) or 0) >= SPARED_BITS
        bits, group = (8, 0) if spared or name in (mix or ()) else (recipe.bits, out.group)
        if group and module.in_features % group:
            out.left_float.append(name)
            continue
        out.linears[name] = (bits, group)
        if grids and types.get(name) in GRID_TYPES:
            out.grids.append(name)
        elif (bits, group) == (4, GRID_BLOCK) and (off_grid(types.get(name)) or mix is not None) \
                and name != "lm_head" and module.in_features > GRID_BLOCK:
            # (a head is applied as a weight: no offset grid for it; nor does torchao quantize
            # the one-column offsets of a one-block input)
            out.regrid.append(name)
        if spared:
            higher.append((module.weight.numel() < largest, name))
        elif name in (mix or ()):
            out.more_bits.append(name)
    out.at_8_bits += [name for _, name in sorted(higher, key=lambda h: h[0])]  # largest first
    out.table_from_head = (getattr(cfg, "external_weights", False) and out.embedding == (8, 0)
                           and out.linears.get("lm_head") == (8, 0) and _tied(model))
    out.experts = _plan_experts(model, recipe.bits, out.group, experts_refused,
                                _formulation(getattr(cfg, "experts", "auto")))
    if not out.linears:
        raise InputError(f"quantize: no linear layer's input width is a multiple of group_size "
                         f"{out.group}; choose a group size that divides the hidden size, or 0 "
                         "for per-channel")
    return out


def _tied(model) -> bool:
    """Whether the model's head is its one table under a Parameter of its own
    (separate_tied_head)."""
    from ..architectures.layers import storage

    head, table = getattr(model, "lm_head", None), embedding_name(model)
    tables = sum(isinstance(m, nn.Embedding) for m in model.modules())
    return head is not None and tables == 1 and storage(head.weight) == storage(
        model.get_submodule(table).weight)


def _plan_tables(out: Plan, model, cfg, recipe, types: dict, four_bit: bool, mix: bool) -> None:
    """The embedding tables' bits: as asked, except where the head is the table and the source
    spared it while its linears are 4-bit, or a 4-bit mix (`mix`) gives the head more bits:
    there 8 per row, the 8 bits a 4-bit recipe gives a spared head (as XNNPACK's separate head
    gets them), even when no table recipe was asked. A separate head keeps its own 8 bits
    whatever the table takes."""
    stored = four_bit and (stored_bits(types.get("embedding")) or 0) >= SPARED_BITS
    spared = stored or mix
    head_is_table = getattr(model, "lm_head", None) is None
    if cfg.embedding_quantize:
        out.embedding = parse_embedding(cfg.embedding_quantize)
        if out.embedding[0] == 4 and spared and head_is_table:
            out.embedding, out.embeddings = (8, 0), "8,0"
            out.embeddings_stored_as = types["embedding"] if stored else None
            if not stored:
                out.more_bits.append("lm_head")
    elif head_is_table and recipe is not None and recipe.bits == 4 and spared:
        out.embedding, out.embeddings = (8, 0), "8"
        out.embeddings_stored_as = types["embedding"] if stored else None
        (out.at_8_bits if stored else out.more_bits).append("lm_head")
    if out.embedding is None:
        return
    out.head_in_table = head_is_table
    group = out.embedding[1]
    widths = [m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)]
    if group and widths and all(w % group for w in widths):
        raise InputError(f"embedding_quantize: group {group} does not divide the embedding "
                         "width; choose a group that divides the hidden size, or 0 per row")


def _formulation(experts: str) -> str:
    """config.experts -> how the experts run: auto is chosen (a recipe's experts reach XNNPACK
    only: Core ML, the other backend with recipes, refuses them)."""
    return "chosen" if experts == "auto" else experts


def _plan_experts(model, bits: int, group: int, refused: str | None,
                  formulation: str = "op") -> tuple | None:
    """(bits, group, formulation) for every sparse block's experts, or None without such blocks:
    "op", llama::quantized_moe_ffn (4 or 8 bits per group, one group for both matrices),
    "chosen", an expert apiece as linears of the recipe, or "every", every expert as two linears
    of the recipe; InputError where the op (or the linears' group), or the backend that writes
    the model (`refused`: why it cannot), cannot take them."""
    from ..architectures.moe import SparseMoE, quantizable

    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if blocks and refused:
        raise InputError(f"quantize: mixture-of-experts layers on {refused}")
    why = next((w for w in (quantizable(b, group) for b in blocks) if w), None)
    if why:
        via = {"op": "ExecuTorch's llama::quantized_moe_ffn",
               "chosen": "linears of the recipe (--experts chosen)",
               "every": "two linears of the recipe (--experts every)"}[formulation]
        raise InputError(f"quantize: the experts go through {via}, and {why}; choose a "
                         "group_size that divides both (32 or 64 usually)")
    return (bits, group, formulation) if blocks else None
