"""Quantization recipes: what each is, the torchao config that makes it, the accuracy it must keep,
and what a recipe asks that a chain of backends cannot give (read from each backend's `recipes`,
`refuses` and `quantized_embeddings`).

Linear recipes:
- `8da4w`, `8da8w`: 8-bit dynamic per-token activations, 4- or 8-bit weights
  (`Int8DynamicActivationIntxWeightConfig`, HQQ scale search, like ExecuTorch `export_llm`'s
  `qmode` of the same name). 4-bit is group-wise (128 unless given) or per channel (group 0);
  8-bit is per channel.
- `4w`, `8w`: weight-only (`IntxWeightOnlyConfig`, HQQ scales too). 4-bit defaults to blocks of
  32 (export_llm's `b4w`); group 0 is per channel (`c4w`).

A 4-bit recipe at group 32 over a source that made no linear 4-bit (float weights) quantizes as
llama.cpp's 4-bit mixes instead: Q4_1's grid, 8 bits where 4 lose most (plan.py).

Embeddings (`embedding_quantize: "BITS[,GROUP]"`, export_llm's syntax): weight-only 8- or 4-bit
tables. Nothing here imports torch until a config is made.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    bits: int
    dynamic: bool  # 8-bit dynamic activations (else weight-only)
    default_group: int  # 0: per channel
    # (min SQNR dB, min top-1, max perplexity ratio) against the float model: verify checks
    bounds: tuple[float, float, float]
    per_channel_only: str | None = None  # why a group size > 0 is refused, if it is


RECIPES = {
    "8da4w": Recipe(4, True, 128, (10.0, 0.6, 1.25)),
    "8da8w": Recipe(8, True, 0, (15.0, 0.8, 1.10), per_channel_only=(
        "XNNPACK quantizes 8-bit weights per channel only (group-wise kernels exist for 4-bit)")),
    "4w": Recipe(4, False, 32, (10.0, 0.6, 1.25)),
    "8w": Recipe(8, False, 0, (15.0, 0.8, 1.05)),
}
HQQ = "hqq_scale_only"  # every recipe's scale search, as export_llm's (its `use_hqq: true`)
EMBEDDING_DEFAULT_GROUP = {8: 0, 4: 32}
# bounds of an embedding recipe alone
EMBEDDING_BOUNDS = {8: (30.0, 0.9, 1.02), 4: (15.0, 0.7, 1.10)}
# bounds of a KV cache dtype alone (config.KV_CACHES), against the program with float caches
KV_CACHE_BOUNDS = {"int8": (30.0, 0.9, 1.05)}


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


def problems(cfg, chain, every) -> list[str]:
    """Recipe choices the chain of backends (`chain`, Backend objects in order; `every`: all of
    them, to say which take what) cannot honour, each with the reason (config validation)."""
    out = []
    first = chain[0] if chain else None
    recipe = RECIPES.get(cfg.quantize) if cfg.quantize else None
    if cfg.quantize is not None and recipe is None:
        out.append(f"quantize: '{cfg.quantize}' is not one of {', '.join(RECIPES)}")
    elif recipe and first:
        out.extend(_chain_problems(cfg.quantize, chain, every))
    if cfg.group_size is not None and cfg.quantize is None:
        out.append(f"group_size: {cfg.group_size} is set but quantize is not; set quantize "
                   f"(one of {', '.join(RECIPES)}) or drop group_size")
    if isinstance(cfg.group_size, int) and cfg.group_size < 0:
        out.append(f"group_size: {cfg.group_size} is negative; use 0 for per-channel")
    elif recipe and recipe.per_channel_only and isinstance(cfg.group_size, int) \
            and cfg.group_size > 0:
        out.append(f"group_size: {cfg.group_size} with {cfg.quantize}; "
                   f"{recipe.per_channel_only}: use group_size 0 or leave it unset")
    if cfg.embedding_quantize is not None:
        try:
            parse_embedding(cfg.embedding_quantize)
        except ValueError as e:
            out.append(str(e))
        else:
            if first and not first.quantized_embeddings:
                able = ", ".join(b.name for b in every if b.quantized_embeddings)
                out.append(f"embedding_quantize: {first.name} has no quantized embedding kernels;"
                           f" use one of {able} or drop it")
    return out


def _chain_problems(name: str, chain, every) -> list[str]:
    """A recipe the first backend has no kernels for, or that a backend of the chain refuses."""
    first = chain[0]
    refusing = next((b for b in chain if name in b.refuses), None)
    if name not in first.recipes and name not in first.refuses:
        where, why = first.name, f"{first.name} has no kernels for it"
    elif refusing is not None:
        where = refusing.name + ("" if refusing is first else " (in the chain)")
        why = refusing.refuses[name]
    else:
        return []
    per_backend = "; ".join(f"{b.name}: {', '.join(b.recipes)}" for b in every if b.recipes)
    return [f"quantize: {name} on {where}: {why}. Recipes per backend: {per_backend}"]


def accuracy_bounds(cfg) -> tuple[float, float, float]:
    """(min SQNR dB, min top-1, max perplexity ratio) the quantized program must reach against
    the float model: for each, the loosest of the linear, embedding and KV cache recipes that
    apply, and no looser. The perplexity ratio (the program's perplexity along the shipped text
    over fp32's) does not move with the logits' scale, which SQNR and top-1 do on a real model."""
    bounds = [KV_CACHE_BOUNDS[cfg.kv_cache]] if cfg.kv_cache else []
    if cfg.quantize:
        bounds.append(RECIPES[cfg.quantize].bounds)
    if cfg.embedding_quantize:
        bounds.append(EMBEDDING_BOUNDS[parse_embedding(cfg.embedding_quantize)[0]])
    return (min(b[0] for b in bounds), min(b[1] for b in bounds), max(b[2] for b in bounds))


def torchao_config(bits: int, group: int, dynamic: bool, algorithm: str = HQQ,
                   exact: bool = False):
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


# a GGUF storage type's bits at or above which the file's author spared the tensor (llama.cpp's
# K-quant mixes give the sensitive tensors Q6_K or Q8_0, and take Q5_0 / Q5_1 where a row is not
# a multiple of 256 in place of their 4- or 5-bit K type): those become 8-bit, the rest 4-bit
SPARED_BITS = 6
FILE_DTYPES = {"F16": "fp16", "BF16": "bf16"}
# 4-bit types whose 16 levels lie on no uniform grid (llama.cpp's non-linear IQ4 codebook, a
# scale per block): any 4-bit grid of their values is a second 4-bit quantization (the real
# SmolLM2's IQ4_NL on Q4_1's grid: 21.4 dB, perplexity 1.65x fp32's, verification failed;
# BENCHMARKS.md), so they are held at 8 bits as a file's 6- and 8-bit tensors are
UNGRIDDED_4BIT = ("IQ4_NL", "IQ4_XS")


def stored_bits(kind: str | None) -> int | None:
    """Bits per weight a uniform grid needs to hold a GGUF storage type: 'Q4_1' -> 4, 'Q8_0' ->
    8, 'F16' -> 16; the IQ4 types, on no uniform grid, SPARED_BITS (UNGRIDDED_4BIT)."""
    import re

    if kind in UNGRIDDED_4BIT:
        return SPARED_BITS
    found = re.search(r"\d+", kind or "")
    return int(found.group()) if found else None


def file_recipe(kinds: dict, backend, bits: int | None = None, external: bool = False) -> dict:
    """The recipe that keeps a quantized file's precision on `backend` (the chain's first), as
    config fields: `kinds` maps each weight of the file to (storage type, values), the table
    under "embedding". Linears mostly below SPARED_BITS (by values) take the backend's 4-bit
    recipe at the file's block of 32 (grids kept, tensors spared by the author at 8 bits:
    plan.py), else its 8-bit one, per channel; where the backend has quantized tables, the table
    4 bits beside 4-bit linears (except a table the file spared, at 6 bits or more, that the
    backend does not also write as a separate head: it keeps 8) and 8 beside 8-bit ones; a file
    of F16 or BF16 linears its dtype. `external` (--external-weights): a tied table and its
    separate head are one buffer in the data file, so the table keeps 8 bits. `bits` forces the linears' bits
    (8: the fallback where a backend's options refuse its 4-bit recipe). {} for a float file,
    or where the backend has no recipe for it (a float program, as before)."""
    linears = {n: k for n, k in kinds.items() if n != "embedding"}
    by_kind: dict = {}
    for kind, values in linears.values():
        by_kind[kind] = by_kind.get(kind, 0) + values
    if not by_kind:
        return {}
    kind = max(by_kind, key=by_kind.get)
    if kind in FILE_DTYPES:
        return {"dtype": FILE_DTYPES[kind]}
    if kind == "F32" or stored_bits(kind) is None:
        return {}
    low = sum(v for k, v in by_kind.items() if (stored_bits(k) or 32) < SPARED_BITS)
    want = bits or (4 if low * 2 >= sum(by_kind.values()) else 8)
    recipe = next((r for r in backend.recipes if RECIPES[r].bits == want), None)
    if recipe is None:
        return {}
    out = {"quantize": recipe, "group_size": 32 if want == 4 else 0}
    table = kinds.get("embedding")
    if backend.quantized_embeddings and table and stored_bits(table[0]) not in (None, 32):
        # a tied table that the backend also writes as a separate head is stored twice: the
        # lookups take 4 bits and the head keeps the file's 8 (plan.py); in a data file, once
        twice = ("output.weight" not in kinds and backend.writing.get("separate_head")
                 and not external)
        low = want == 4 and (stored_bits(table[0]) < SPARED_BITS or twice)
        out["embedding_quantize"] = "4,32" if low else "8"
    return out
