"""A quantization plan applied to the eager model, in place, through torchao's `quantize_`: the
tables, then the source's grids kept exactly, then every other planned linear."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .. import patches
from ..architectures.loading import read_pending
from ..memory import drop_checkpoint_pages
from .cost import cost, float_rows, sample, sqnr_db
from .experts import quantize_experts
from .grid import GRID_BLOCK, GRID_TYPES, REGRID_TYPE, grid_table, keep_grids, packed_bytes
from .plan import Plan, embedding_name, plan
from .recipes import SPARED_BITS, torchao_config

# While linears are quantized, the checkpoint pages of those already done are dropped once this
# many float bytes have been (each drop reads /proc/self/smaps, too slow to do per linear)
DROP_PAGES_EVERY = 64 << 20
QUANTIZE_PATCHES = ("torchao.hqq_in_blocks",)


@dataclass
class Quantized:
    """What quantize() did: report.json's `quantization`, and the bytes a decode step saves."""

    recipe: str | None
    group_size: int | None
    embeddings: str | None
    bytes_saved: int = 0  # per decode step
    linears_quantized: int = 0
    linears_left_float: list = field(default_factory=list)  # inputs the group does not divide
    linears_on_source_grid: int = 0  # 4-bit grids kept (GGUF Q4_0 / Q4_1 / Q4_K)
    linears_regridded: int = 0  # on no 4-bit grid in the source (Q5_0, IQ4_NL): on Q4_1's
    table_on_source_grid: bool = False  # the table's 4-bit grid kept exactly
    linears_at_8_bits: list = field(default_factory=list)  # the source stores them above 4 bits
    linears_more_bits: list = field(default_factory=list)  # 8 bits where a 4-bit grid loses most
    expert_blocks_packed: int = 0  # sparse blocks whose experts were quantized
    experts: str | None = None  # how they run: "op", "chosen" or "every" (config.experts)
    embeddings_stored_as: str | None = None  # the source's type that kept the table at 8 bits
    # {source storage type: {what its tensors became: how many}}: a quantized file's choices
    from_source: dict = field(default_factory=dict)
    patches: dict = field(default_factory=dict)  # {name: "on" or why not}: report.json's `patches`

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("bytes_saved", "patches")
                and (v or k not in ("expert_blocks_packed", "experts",  # mixture of experts
                                    "table_on_source_grid", "linears_regridded",
                                    "linears_more_bits"))}

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
        for kind, became in self.from_source.items():
            out.append(f"[edgellm] quantize: {kind} tensors -> " + ", ".join(
                f"{to} ({e['tensors']}" + ("" if e["weight_sqnr_db"] is None else
                                           f", weights at {e['weight_sqnr_db']} dB") + ")"
                for to, e in became.items()))
        if self.linears_more_bits:
            more = self.linears_more_bits
            out.append(f"[edgellm] quantize: as llama.cpp's 4-bit mixes, {self.linears_regridded}"
                       f" linears on {REGRID_TYPE}'s grid and {len(more)} at 8 bits, where 4 lose"
                       f" most ({', '.join(more[:3])}{', ...' if len(more) > 3 else ''})")
        if self.linears_at_8_bits:
            eight = self.linears_at_8_bits
            many = "linears get" if len(eight) > 1 else "linear gets"
            out.append(f"[edgellm] quantize: {len(eight)} {many} 8-bit weights: the source "
                       f"stores them at {SPARED_BITS} bits or more ({', '.join(eight[:3])}"
                       f"{', ...' if len(eight) > 3 else ''})")
        return out


@torch.no_grad()
def quantize(model, cfg, stored: dict | None = None,
             experts_refused: str | None = None) -> Quantized:
    """Quantize the model's nn.Linear weights (cfg.quantize) and nn.Embedding tables
    (cfg.embedding_quantize) in place, as `plan.plan` decides; `stored` maps HF parameter names
    to the source's storage types (GGUF); `experts_refused` as plan.plan's. Returns what was
    done and how many bytes a decode step reads fewer (float weights replaced by packed ones and
    one fp32 scale per group; an embedding step reads one row either way, unless the head is the
    table). Without autograd, as torch.export runs: the float weights require grad, and autograd
    recorded every op of HQQ's twenty passes (the same values, several times slower:
    BENCHMARKS.md, where an export's time goes)."""
    todo = plan(model, cfg, stored, experts_refused)
    done = Quantized(todo.recipe, todo.group, todo.embeddings,
                     linears_left_float=list(todo.left_float),
                     linears_at_8_bits=list(todo.at_8_bits),
                     linears_more_bits=list(todo.more_bits),
                     embeddings_stored_as=todo.embeddings_stored_as)
    costs: dict = {}  # name -> (signal, noise) of what quantizing it cost (cost.py)
    kept = set()  # the linears, and "embedding", kept on the source's 4-bit grid
    if todo.embedding is not None and not todo.table_from_head:
        saved, done.table_on_source_grid = _quantize_tables(model, todo, costs)
        done.bytes_saved += saved
        kept |= {"embedding"} if done.table_on_source_grid else set()
    if todo.recipe is None:
        done.from_source = _from_source(todo, kept, costs)
        return done
    done.patches = patches.apply(QUANTIZE_PATCHES)
    on_grids = keep_grids(model, todo.grids, todo.dynamic, todo.regrid, costs)
    linears = {name for name, _ in on_grids}
    done.linears_on_source_grid = len(linears - set(todo.regrid))
    done.linears_regridded = len(linears & set(todo.regrid))
    done.bytes_saved += sum(saved for _, saved in on_grids) + _quantize_linears(model, todo, costs)
    done.linears_quantized = len(todo.linears)
    if todo.table_from_head:
        _table_from_head(model, costs)
    done.from_source = _from_source(todo, kept | linears, costs)
    if todo.experts:
        # `--experts chosen` without verification, which would run them eagerly: each block's
        # experts quantized as the experts stage lowers them (lower.lower_experts), never all
        # at once
        done.expert_blocks_packed, saved = quantize_experts(
            model, *todo.experts, todo.dynamic, later=not getattr(cfg, "verify", True))
        done.experts = todo.experts[2]
        done.bytes_saved += saved
    return done


def _from_source(todo: Plan, kept: set, costs: dict) -> dict:
    """{storage type: {what its tensors became: {"tensors": count, "weight_sqnr_db": what it
    cost}}} over the source's linears and table: the SQNR of their weights as the program holds
    them against the file's (None where nothing changed), over all the tensors of the entry."""
    out: dict = {}
    for name, kind in todo.source_types.items():
        if name == "embedding":
            bits, group = todo.embedding or (None, None)
            to = ("table float" if bits is None else "table 4-bit, the file's grid kept"
                  if name in kept else f"table {_form(bits, group)}")
        elif name in kept and name in todo.regrid:
            to = f"4-bit on {REGRID_TYPE}'s grid"
        elif name in kept:
            to = "4-bit, the file's grid kept"
        elif name in todo.linears:
            to = _form(*todo.linears[name])
        else:
            to = "float"
        entry = out.setdefault(kind, {}).setdefault(to, [0, 0.0, 0.0])
        signal, noise = costs.get(name, (0.0, 0.0))
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + signal, entry[2] + noise
    return {kind: {to: {"tensors": n, "weight_sqnr_db": sqnr_db(signal, noise)}
                   for to, (n, signal, noise) in became.items()}
            for kind, became in sorted(out.items())}


def _form(bits: int, group: int) -> str:
    return f"{bits}-bit " + ("per channel" if group == 0 else f"in groups of {group}")


def _quantize_tables(model, todo: Plan, costs: dict) -> tuple[int, bool]:
    """The embedding tables at the plan's (bits, group), weight-only: a table the source stored
    on a 4-bit grid, asked at 4 bits in its blocks, keeps that grid exactly (grid.grid_table);
    others get min/max scales. Returns the bytes a decode step saves (those of the head, where
    the head is the table) and whether the source's grid was kept; puts the table's (signal,
    noise) in `costs` under "embedding"."""
    bits, group = todo.embedding
    module = model.get_submodule(embedding_name(model))
    read_pending(module, unless_by_rows=True)  # a GGUF's table: quantize_rows reads its rows
    table = module.weight
    before = sample(table)
    saved = table.numel() * table.element_size() - packed_bytes(table, bits, group)
    saved = saved if todo.head_in_table else 0
    if (bits, group) == (4, GRID_BLOCK) and todo.source_types.get("embedding") in GRID_TYPES \
            and not todo.head_in_table:  # a head applies the table as a weight: no offset grid
        read_pending(module)
        kept = grid_table(module.weight)
        if kept is not None:
            module.weight = nn.Parameter(kept, requires_grad=False)
            costs["embedding"] = cost(before, module)
            return saved, True
    config = torchao_config(bits, group, dynamic=False, algorithm="affine")
    for table in model.modules():
        if isinstance(table, nn.Embedding) and (group == 0 or table.embedding_dim % group == 0):
            quantize_rows(table, config)
    costs["embedding"] = cost(before, module)
    drop_checkpoint_pages()  # the float table's pages and heap, before the linears
    return saved, False


def _table_from_head(model, costs: dict) -> None:
    """The table as its tied head's 8-bit codes and scales, weight-only (Plan.table_from_head):
    the same bytes, which a data file stores once. A copy: torch.export lifts them as the two
    parameters they are, and the data file's NamedDataStore merges them by content."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    module = model.get_submodule(embedding_name(model))
    read_pending(module, unless_by_rows=True)  # a GGUF's table: sampled by rows, never read
    before = sample(module.weight)
    head = model.lm_head.weight
    module.weight = nn.Parameter(IntxUnpackedToInt8Tensor(
        head.qdata.clone(), head.scale.clone(), head.zero_point.clone(), head.target_dtype,
        head.block_size, head.dtype, activation_quantization=None), requires_grad=False)
    costs["embedding"] = cost(before, module)
    drop_checkpoint_pages()


def _quantize_linears(model, todo: Plan, costs: dict) -> int:
    """Every planned linear not already on a kept grid, each on its own through its (bits, group)
    torchao config; returns the bytes a decode step saves, and puts each one's (signal, noise)
    in `costs`. The largest linears (the head) go first, then the spared ones (8 bits per
    channel): HQQ holds several float copies of a weight while it works, and these then come
    while little else is held. Each weight is quantized on its own, so the order changes no
    byte."""
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)
               and fqn in todo.linears and not hasattr(m.weight, "qdata")]  # not a kept grid
    largest = max((m.weight.numel() for _, m in linears), default=0)
    linears.sort(key=lambda n_m: (n_m[1].weight.numel() < largest, todo.linears[n_m[0]] != (8, 0)))
    configs = {kind: torchao_config(*kind, todo.dynamic) for kind in set(todo.linears.values())}
    saved, pending = 0, 0  # float bytes quantized since checkpoint pages were last dropped
    for fqn, module in linears:
        bits, group = todo.linears[fqn]
        saved += module.weight.nbytes - packed_bytes(module.weight, bits, group)
        pending += module.weight.nbytes
        if pending >= DROP_PAGES_EVERY:  # those of the linears quantized before this one
            drop_checkpoint_pages()
            pending = 0
        read_pending(module, unless_by_rows=True)  # else sample and quantize_rows read rows
        before = sample(module.weight)
        quantize_rows(module, configs[bits, group])
        costs[fqn] = cost(before, module)
    return saved


# weights: a larger tensor is quantized a block of rows at a time; HQQ's search (whose early
# stop looks at the whole tensor) only past ROWS_APART, min/max scales, row by row, past EXACT_
ROWS_APART = 50_000_000
EXACT_ROWS_APART = 4_000_000
BLOCK_WEIGHTS = 4_000_000  # weights in each such block
DROP_EVERY_BLOCKS = 4  # blocks between two drop_checkpoint_pages: every 64 MB of fp32 rows


def quantize_rows(module: nn.Module, config) -> None:
    """torchao's `quantize_` of one linear's or table's weight. One of more than ROWS_APART
    weights (a 262,144-row table and its head), or EXACT_ROWS_APART under min/max scales (a
    table), goes a block of rows at a time, joined after: every config here scales a row or
    groups within a row, so the blocks give the whole tensor's values (HQQ's search, whose early
    stop asks the whole tensor, could stop a block sooner: only past ROWS_APART), and torchao's
    float temporaries are a block's instead of several copies of the table (BENCHMARKS.md, peak
    memory of a GGUF export). A weight still in the checkpoint is read whole, or, a block at a
    time, by rows (pending.Pending.rows)."""
    from torchao.quantization import quantize_

    exact = getattr(config, "intx_choose_qparams_algorithm", None) == "affine"
    whole = module.weight.numel() <= (EXACT_ROWS_APART if exact else ROWS_APART)
    read_pending(module, unless_by_rows=not whole)  # from the checkpoint, if it was left there
    weight = module.weight
    if whole:
        quantize_(module, config, filter_fn=lambda m, f: True)
        return
    rows, read, joined = max(1, BLOCK_WEIGHTS // weight.shape[1]), float_rows(weight), None
    for start in range(0, weight.shape[0], rows):
        # a module of the same kind holding the block: the config's transform reads its weight
        piece = nn.Embedding(1, 1) if isinstance(module, nn.Embedding) else nn.Linear(1, 1, False)
        piece.weight = nn.Parameter(read(start, start + rows).detach().to(weight.dtype),
                                    requires_grad=False)
        quantize_(piece, config, filter_fn=lambda m, f: True)
        part = piece.weight
        if joined is None:  # each field is per row (codes, a row's or its groups' scales)
            names, meta = part.__tensor_flatten__()
            kind, joined = type(part), {n: torch.empty(
                (weight.shape[0], *getattr(part, n).shape[1:]), dtype=getattr(part, n).dtype)
                for n in names}
        for n in names:  # into the whole weight's fields: no second copy to join
            joined[n][start:start + rows] = getattr(part, n)
        if (start // rows) % DROP_EVERY_BLOCKS == DROP_EVERY_BLOCKS - 1:
            drop_checkpoint_pages()  # the rows read so far, from the file, and freed heap
    module.weight = nn.Parameter(kind.__tensor_unflatten__(joined, meta, None, None),
                                 requires_grad=False)
