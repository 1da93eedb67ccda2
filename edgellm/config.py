"""User choices as frozen dataclasses: YAML files, `key=value` overrides, one validation pass.

ExportConfig's fields are the one list of export options: YAML keys, `key=value` overrides,
keywords of `edgellm.export` and the `edgellm export` flags (cli.py makes one per field from its
metadata) are all these names. A config file is a flat mapping of those fields plus one section
per backend for that backend's own options (`coreml: {min_ios: 18}`). Overrides use dotted keys
(`coreml.min_ios=17`) and YAML values. Validation collects every problem and raises one
ConfigError listing them all; a misspelt key gets the nearest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ConfigError

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # name -> torch's
KV_CACHES = ("int8",)  # cache dtypes besides the model's own
# how a recipe runs mixture-of-experts layers; auto: chosen (quantize.plan)
EXPERT_FORMULATIONS = ("auto", "op", "chosen", "every")


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def option(default, help: str, *, flag: str | None = None, short: str | None = None,
           metavar: str | None = None, choices=None, cli: bool = True, **kwargs):
    """A field of ExportConfig with what its `edgellm export` flag needs: the help text, and
    where they differ from the field's name, the flag (`--backend`), a short form and a metavar.
    `cli=False`: not a flag (the model is positional)."""
    meta = {"help": help, "flag": flag, "short": short, "metavar": metavar, "choices": choices,
            "cli": cli}
    return field(default=default, metadata=meta, **kwargs)


@dataclass(frozen=True)
class ExportConfig:
    model: str | None = option(None, "a Hugging Face folder, .gguf file or ExecuTorch .pth; the "
                               "embedded SmolLM2-135M when omitted", cli=False)
    output: str = option("edgellm-out", "output folder (default edgellm-out)", short="-o")
    backends: tuple[str, ...] = option(("xnnpack",), "backend or chain, e.g. xnnpack, "
                                       "coreml,xnnpack (default xnnpack)", flag="--backend")
    max_seq_len: int = option(128, "longest prompt chunk one call takes (default 128)")
    max_context_len: int | None = option(None, "KV cache length (default max-seq-len)")
    allow_long_context: bool = option(False, "allow a context (max-context-len, else "
                                      "max-seq-len) beyond the model's max_position_embeddings")
    prefill_chunk: int = option(0, "also export a `prefill` method taking this many tokens per "
                                "call (0: none)")
    dtype: str = option("fp32", "weights and activations (default fp32, or an F16/BF16 GGUF's "
                        "own)", choices=tuple(DTYPES))
    quantize: str | None = option(None, "linear weight recipe: 8da4w, 8da8w (xnnpack); 4w, 8w "
                                  "(coreml, weight-only); default none, or from a quantized "
                                  "GGUF the recipe that keeps its quantization (unless --dtype, "
                                  "--group-size or --embedding-quantize is given)")
    group_size: int | None = option(None, "quantization group size (0: per channel; default "
                                    "128 for 8da4w, 32 for 4w and for 8da4w from a "
                                    "Q4_0/Q4_1/Q4_K GGUF, whose grid it keeps)")
    embedding_quantize: str | None = option(None, "quantize embedding tables: 8 or 4 bits, e.g. "
                                            "8 or 4,32", metavar="BITS[,GROUP]")
    experts: str = option("auto", "how a recipe runs mixture-of-experts layers: chosen (an "
                          "XNNPACK delegate per expert, run only when a token chose it), op "
                          "(ExecuTorch's llama::quantized_moe_ffn on the chosen experts: exports "
                          "much faster, but its fast kernels are aarch64's: far slower on x86; "
                          "BENCHMARKS.md) "
                          "or every (every expert as two XNNPACK linears weighted by the routing: "
                          "reads all experts) (default auto: chosen)",
                          choices=EXPERT_FORMULATIONS)
    kv_cache: str | None = option(None, "KV cache dtype: int8 (per token and head, ExecuTorch's "
                                  "quantized cache; xnnpack, portable); default the model's "
                                  "dtype", choices=KV_CACHES)
    attention_sink: tuple[int, ...] | None = option(
        None, "keep the first SINK positions and a ring of the last WINDOW in every full "
        "attention layer: the program generates past max_context_len (StreamingLLM)",
        metavar="SINK,WINDOW")
    memory_budget: str | None = option(None, "refuse, before exporting, a program whose weights "
                                       "and state would not fit this much memory (e.g. 4GB), "
                                       "saying what it would take", metavar="SIZE")
    external_weights: bool = option(False, "keep the weights in foundation.ptd beside a "
                                    "model.pte that holds none (xnnpack, portable); a tied "
                                    "table and its head are stored there once")
    etrecord: bool = option(False, "also write etrecord.bin for ExecuTorch's devtools")
    verify: bool = option(True, "skip checking the program against the checkpoint after export",
                          flag="--no-verify")
    force: bool = option(False, "replace an existing output folder")
    params: str | None = option(None, "ExecuTorch params JSON describing a .pth model")
    model_class: str | None = option(None, "ExecuTorch model class of a .pth model, e.g. "
                                     "lfm2_5_350m")
    tokenizer: str | None = option(None, "tokenizer.json (or its folder) to ship instead of the "
                                   "model's")
    bos_id: int | None = option(None, "the BOS id the runner uses, instead of the checkpoint's")
    eos_ids: tuple[int, ...] | None = option(None, "the EOS ids the runner stops at, instead of "
                                             "the checkpoint's (comma-separated)")
    backend_options: Mapping[str, Any] = field(default_factory=dict, metadata={"internal": True})

    @property
    def context_len(self) -> int:
        return self.max_context_len or self.max_seq_len

    def options_for(self, backend: str):
        from .backends import get_backend

        return self.backend_options.get(backend) or get_backend(backend).options()

    def to_dict(self) -> dict:
        """The resolved config, in the same shape `from_dict` reads: it replays the run."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["backends"] = list(self.backends)
        out["max_context_len"] = self.context_len
        del out["backend_options"], out["force"]
        for name in self.backends:
            out[name] = dataclasses.asdict(self.options_for(name))
        return out


def _check_value(name: str, tp, value, problems: list[str]):
    """Coerce `value` to type `tp` (int, bool, str, optionals, tuples of str); report mismatches."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        item = args[0]
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            value = [v.strip() for v in str(value).split(",") if v.strip()]
            value = [int(v) if item is int and v.lstrip("-").isdigit() else v for v in value]
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            what = "integers" if item is int else "names"
            problems.append(f"{name}: expected a list of {what}, got {value!r}")
            return None
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{name}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{name}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            problems.append(f"{name}: expected a string, got {value!r}")
            return value
        return str(value)
    return value


def build_dataclass(cls, data: Mapping[str, Any], prefix: str, problems: list[str],
                    sections: tuple[str, ...] = ()):
    """Build frozen dataclass `cls` from `data`, appending every problem to `problems`."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)
             if f.name in hints and f.init and not f.metadata.get("internal")]
    kwargs, mistyped = {}, 0
    for key, value in data.items():
        if key not in names:
            known = names + list(sections)
            hint = difflib.get_close_matches(str(key), known, n=1)
            more = (f" Did you mean '{prefix}{hint[0]}'?" if hint
                    else f" Known: {', '.join(prefix + k for k in known)}.")
            problems.append(f"unknown key '{prefix}{key}'.{more}")
            continue
        n = len(problems)
        kwargs[key] = _check_value(prefix + key, hints[key], value, problems)
        mistyped += len(problems) - n
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        problems.append(f"{prefix.rstrip('.') or cls.__name__}: {e}")
        return None
    if hasattr(obj, "problems") and not mistyped:  # values are checked once their types are right
        problems.extend(f"{prefix}{p}" for p in obj.problems())
    return obj


def from_dict(data: Mapping[str, Any]) -> ExportConfig:
    """Validate a config mapping (from YAML and overrides) into an ExportConfig."""
    from .backends import (BACKENDS, check_chain, external_problems, kv_cache_problems,
                           sink_problems)
    from .quantize.recipes import problems as recipe_problems

    if not isinstance(data, Mapping):
        raise ConfigError(["a config must be a mapping of keys to values, got "
                           f"{type(data).__name__}"])
    problems: list[str] = []
    top = {k: v for k, v in data.items() if k not in BACKENDS}
    if "backend" in top and "backends" not in top:  # the CLI flag is --backend
        top["backends"] = top.pop("backend")
    cfg = build_dataclass(ExportConfig, top, "", problems, sections=tuple(BACKENDS))
    options = {}
    for name in BACKENDS:
        section = data.get(name)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            problems.append(f"{name}: expected a mapping of options, got {section!r}")
            continue
        options[name] = build_dataclass(BACKENDS[name].options, section, f"{name}.", problems)
    if cfg is not None:
        problems.extend(_problems(cfg))
        chain = [BACKENDS[n] for n in cfg.backends if n in BACKENDS]
        problems.extend(recipe_problems(cfg, chain, list(BACKENDS.values())))
        problems.extend(check_chain(cfg.backends))
        problems.extend(sink_problems(cfg, chain))
        problems.extend(external_problems(cfg, chain))
        if cfg.kv_cache in KV_CACHES:
            problems.extend(kv_cache_problems(cfg.kv_cache, chain, list(BACKENDS.values())))
        for name in cfg.backends:
            backend, opts = BACKENDS.get(name), options.get(name)
            if backend and backend.config_problems and not problems:
                problems.extend(backend.config_problems(cfg, opts or backend.options()))
        for name in options:
            if name not in cfg.backends:
                problems.append(f"options given for backend '{name}', which is not in backends "
                                f"{list(cfg.backends)}: add it to backends or remove the section")
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(cfg, backend_options=options)


SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text) -> int:
    """'4GB', '4G', '4GiB', '512MB', '1.5G' or a number of bytes -> bytes (binary units, as memory
    is sold); raises ValueError naming what is allowed."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"memory_budget: {text!r} is not a size; give e.g. 4GB, 512MB or a "
                         "number of bytes")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


def _problems(cfg: ExportConfig) -> list[str]:
    out = []
    if cfg.memory_budget is not None:
        try:
            parse_size(cfg.memory_budget)
        except ValueError as e:
            out.append(str(e))
    if cfg.dtype not in DTYPES:
        out.append(f"dtype: '{cfg.dtype}' is not one of {', '.join(DTYPES)}")
    if cfg.experts not in EXPERT_FORMULATIONS:
        out.append(f"experts: '{cfg.experts}' is not one of {', '.join(EXPERT_FORMULATIONS)}")
    elif cfg.experts in ("chosen", "every") and not cfg.quantize:
        out.append(f"experts: '{cfg.experts}' is how a recipe's experts run; without --quantize "
                   "they stay float, gathered per token (the chosen ones only)")
    if cfg.kv_cache is not None and cfg.kv_cache not in KV_CACHES:
        out.append(f"kv_cache: '{cfg.kv_cache}' is not one of {', '.join(KV_CACHES)} (leave it "
                   "unset for caches in the model's dtype)")
    out.extend(_sink_problems(cfg))
    if cfg.params is not None and (cfg.model is None or str(cfg.model).endswith(".gguf")):
        out.append("params: an ExecuTorch params JSON describes a .pth checkpoint (or is checked "
                   f"against a Hugging Face folder), but model is {cfg.model!r}; a GGUF carries "
                   "its own config")
    if isinstance(cfg.max_seq_len, int) and not 1 <= cfg.max_seq_len <= 131072:
        out.append(f"max_seq_len: {cfg.max_seq_len} is out of range 1..131072")
    chunk, ctx = cfg.prefill_chunk, cfg.max_context_len
    if isinstance(chunk, int) and isinstance(cfg.context_len, int) and not (
            0 <= chunk <= cfg.context_len):
        out.append(f"prefill_chunk: {chunk} is out of range 0..{cfg.context_len} "
                   "(max_context_len); 0 means no prefill method")
    if isinstance(ctx, int) and isinstance(cfg.max_seq_len, int) and ctx < cfg.max_seq_len:
        out.append(f"max_context_len: {ctx} is smaller than max_seq_len {cfg.max_seq_len}; "
                   "the cache must hold at least one full call")
    return out


def _sink_problems(cfg: ExportConfig) -> list[str]:
    sink = cfg.attention_sink
    if sink is None:
        return []
    if len(sink) != 2 or sink[0] < 0 or sink[1] < 1:
        return [f"attention_sink: {','.join(map(str, sink))} is not SINK,WINDOW with SINK >= 0 "
                "and WINDOW >= 1 (e.g. 4,1020)"]
    if isinstance(cfg.context_len, int) and isinstance(cfg.max_seq_len, int) \
            and cfg.context_len <= cfg.max_seq_len:
        return [f"attention_sink: needs max_context_len above max_seq_len ({cfg.max_seq_len}): "
                "ExecuTorch's runner goes on past max_context_len only for a program whose "
                "max_seq_len is the smaller, and takes at most max_context_len tokens per "
                f"generate call; e.g. max_context_len {sum(sink) + cfg.max_seq_len}"]
    return []


def resolve_config(model=None, *, config=None, overrides=(), **options):
    """An ExportConfig from a YAML file, `key=value` overrides, then explicit options (in that
    order of precedence, lowest first). Options set to None are left to the file or defaults."""
    from .etconfig import is_executorch, translate

    data = load_yaml(config) if config else {}
    data = apply_overrides(data, list(overrides))
    if is_executorch(data):  # an ExecuTorch export_llm config: base, model, export, backend...
        data = translate(data)
    data.update({k: v for k, v in options.items() if v is not None})
    if model is not None:
        data["model"] = str(model)
    cfg = from_dict(data)
    if not {"dtype", "quantize", "embedding_quantize", "group_size"} & data.keys():
        for recipe in source_recipes(cfg):
            try:
                return from_dict({**data, **recipe})
            except ConfigError:  # the backend's options refuse it (Core ML 4w below iOS 18)
                continue
    return cfg


def source_recipes(cfg: ExportConfig) -> list[dict]:
    """The fields of the recipe that keeps a quantized file's precision on the chain's first
    backend (quantize.recipes.file_recipe), then its 8-bit fallback, for a config that chose no
    dtype or recipe: a GGUF's default program is as small as the file, not a float one. [] for an
    unquantized source."""
    from .backends import get_backend
    from .quantize.recipes import file_recipe
    from .sources import storage_kinds

    kinds = storage_kinds(cfg.model)
    if not kinds:
        return []
    backend = get_backend(cfg.backends[0])
    return [r for r in (file_recipe(kinds, backend, external=cfg.external_weights),
                        file_recipe(kinds, backend, bits=8, external=cfg.external_weights)) if r]


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value). The value is read as YAML; a leading '+' is ignored."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([f"override '{text}' is not of the form key=value "
                           "(e.g. max_seq_len=256)"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of `data` with each dotted `key=value` override applied."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {} if child is None else _not_a_section(text, part)
            node = child
        node[path[-1]] = value
    return out


def _not_a_section(text: str, part: str):
    raise ConfigError([f"override '{text}': '{part}' holds a value, not a section of options"])


def load_yaml(path: str | Path) -> dict:
    """Read a YAML config file with yaml.safe_load; an empty file is an empty config."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError([f"cannot read config file {p}: {e.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"config file {p} is not valid YAML{where}: "
                           f"{getattr(e, 'problem', None) or e}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"config file {p} must hold a mapping of keys to values, "
                           f"got {type(data).__name__}"])
    return data


def dump_yaml(cfg: ExportConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
