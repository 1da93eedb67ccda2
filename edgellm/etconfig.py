"""ExecuTorch `export_llm` YAML configs, read as edgellm configs.

A config (or a `+section.key=value` override) whose top-level keys are ExecuTorch's sections
(`base`, `model`, `export`, `quantization`, `backend`, `debug`) is translated field by field into
edgellm's own keys. Every field edgellm honours maps onto a setting that takes effect; every other
field is refused by name with the reason, never silently dropped (ExecuTorch's own flow parses
`enable_state` and `preserve_sdpa` and then reads neither: pytorch/executorch #22352), and a
field that is no field of ExecuTorch's LlmConfig gets the nearest one that is. What a backend's
`backend.<name>` fields mean is that backend's (`Backend.from_executorch`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .layout import FOUNDATION

SECTIONS = ("base", "model", "export", "quantization", "backend", "debug")
NOT_YET = "edgellm does not support it yet"


def is_executorch(data: Mapping) -> bool:
    """Whether a config is export_llm's: one of its sections (edgellm's own `model` is a path,
    ExecuTorch's a mapping)."""
    return any(k in SECTIONS + ("multimethod",) and (k != "model" or isinstance(v, Mapping))
               for k, v in data.items())


# ExecuTorch field -> the edgellm key it sets ("_" keys are checked against the backends below)
RENAMES = {"base.model_class": "model_class", "base.params": "params",
           "base.checkpoint": "model", "base.tokenizer_path": "tokenizer",
           "model.dtype_override": "dtype", "model.enable_dynamic_shape": "_dynamic",
           "model.use_sdpa_with_kv_cache": "_custom_sdpa",
           "export.max_seq_length": "max_seq_len", "export.max_context_length": "max_context_len",
           "export.output_name": "_output_name", "export.output_dir": "_output_dir",
           "quantization.group_size": "group_size",
           "debug.generate_etrecord": "etrecord"}
# quantization.qmode -> edgellm recipe (quantize/recipes.py); export_llm's int8 and 4w are
# weight-only
QMODES = {"8da4w": "8da4w", "8da8w": "8da8w", "int8": "8w", "4w": "4w"}
# quantization.pt2e_quantize -> (recipe, group_size): the same math through torchao
PT2E = {"xnnpack_dynamic": ("8da8w", 0), "xnnpack_dynamic_qc4": ("8da4w", 0),
        "coreml_c4w": ("4w", 0)}
# fields whose only value edgellm can honour is the one it always has
FIXED = {"model.use_kv_cache": (True, "edgellm programs always keep a KV cache"),
         "quantization.use_hqq": (True, "edgellm's recipes choose scales with HQQ"),
         "debug.verbose": (False, "edgellm prints its own stage lines (--quiet silences them)")}


def translate(data: Mapping[str, Any]) -> dict:
    """ExecuTorch LlmConfig fields -> edgellm config keys; raises ConfigError listing every field
    that cannot be honoured."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for section in set(data) - set(SECTIONS) - {"multimethod"}:
        close = difflib.get_close_matches(str(section), SECTIONS, n=1)
        hint = f" Did you mean {close[0]}?" if close else f" Sections: {', '.join(SECTIONS)}."
        problems.append(f"{section}: unknown section of an ExecuTorch export_llm config.{hint}")
    for section in ("base", "model", "export", "quantization", "debug"):
        fields = data.get(section) or {}
        if not isinstance(fields, Mapping):
            problems.append(f"{section}: expected a mapping of fields, got {fields!r}")
            continue
        for key, value in fields.items():
            _field(f"{section}.{key}", value, out, problems)
    _backends(data.get("backend") or {}, out, problems)
    output_folder(out)
    if data.get("multimethod"):
        problems.append(f"multimethod: {NOT_YET} (edgellm exports forward and, with "
                        "prefill_chunk, prefill)")
    if problems:
        raise ConfigError(problems)
    return out


def _field(name: str, value, out: dict, problems: list[str]) -> None:
    if name in RENAMES:
        if value is not None:
            out[RENAMES[name]] = value
    elif name in FIXED:
        honoured, reason = FIXED[name]
        if value not in (honoured, None):
            problems.append(f"{name}: {value!r} is not supported; {reason} ({name}: "
                            f"{str(honoured).lower()})")
    elif name == "model.quantize_kv_cache":  # the same int8 cache, through the same ops
        if value:
            out["kv_cache"] = "int8"
    elif name == "model.use_attention_sink":  # '<sink_size>,<window_size>': the same window
        if value:
            out["attention_sink"] = value
    elif name == "export.foundation_weights_file" and value is not None:
        if str(value) in (FOUNDATION, f"{FOUNDATION}.ptd"):  # the same file, by its name
            out["external_weights"] = True
        else:
            problems.append(f"{name}: {value!r} is not supported; edgellm writes the weights to "
                            f"{FOUNDATION}.ptd beside model.pte, where its runtime finds them "
                            f"({name}: {FOUNDATION}.ptd)")
    elif name == "base.metadata":
        _metadata(name, value, out, problems)
    elif name.startswith("quantization.") and value is not None:
        _quantization(name, value, out, problems)
    elif value is not None:
        problems.append(_refused(name, value))


def _metadata(name, value, out, problems):
    try:
        meta = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        problems.append(f"{name}: not valid JSON ({e.msg} at column {e.colno})")
        return
    if not isinstance(meta, Mapping):
        problems.append(f"{name}: expected a JSON object, got {value!r}")
        return
    for key, v in meta.items():
        if key == "get_bos_id":
            out["bos_id"] = v
        elif key == "get_eos_ids":
            out["eos_ids"] = v
        else:
            problems.append(f"{name}: key '{key}' is not supported; edgellm writes its own "
                            "runner metadata and takes get_bos_id and get_eos_ids from here")


def _quantization(name, value, out, problems):
    """qmode, embedding_quantize and pt2e_quantize onto edgellm's recipes (quantize/recipes.py)."""
    if name == "quantization.qmode" and value in QMODES:
        _recipe(name, QMODES[value], None, out, problems)
    elif name == "quantization.qmode" and str(value).startswith("torchao:"):
        problems.append(f"{name}: {value!r} needs torchao's own CPU kernel library, which the "
                        "ExecuTorch wheel does not ship; use qmode: 8da4w (XNNPACK kernels)")
    elif name == "quantization.embedding_quantize" and not str(value).startswith("torchao:"):
        out["embedding_quantize"] = str(value)
    elif name == "quantization.embedding_quantize":
        problems.append(f"{name}: {value!r} needs torchao's own CPU kernel library, which the "
                        "ExecuTorch wheel does not ship; use the BITS,GROUP form (e.g. '4,32')")
    elif name == "quantization.pt2e_quantize" and value in PT2E:
        _recipe(name, *PT2E[value], out, problems)
    elif name == "quantization.pt2e_quantize":
        problems.append(f"{name}: {value!r} is not supported; edgellm quantizes weights through "
                        f"torchao (pt2e recipes it maps: {', '.join(PT2E)}); static activation "
                        "quantization needs calibration data, which edgellm does not take")
    else:
        problems.append(_refused(name, value))


def _recipe(name, recipe, group, out, problems):
    if out.get("quantize") not in (None, recipe) or (
            group is not None and out.get("group_size") not in (None, group)):
        chosen = f"{out.get('quantize')} (group_size {out.get('group_size')})"
        problems.append(f"{name}: asks for {recipe}"
                        f"{'' if group is None else f' with group_size {group}'}, but another "
                        f"field already chose {chosen}; keep one quantization field")
        return
    out["quantize"] = recipe
    if group is not None:
        out["group_size"] = group


def _refused(name: str, value) -> str:
    """A field edgellm does not map: misspelt (not a field of ExecuTorch's LlmConfig: the nearest
    one is named) or one edgellm does not support."""
    fields = executorch_fields()
    if name not in fields:
        section = name.rpartition(".")[0]
        known = [f for f in fields if f.rpartition(".")[0] == section] or list(fields)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        return f"{name}: unknown field, not one of ExecuTorch's LlmConfig.{hint}"
    return f"{name}: {value!r} is not supported; {NOT_YET}. Remove it to continue"


@functools.cache
def executorch_fields() -> tuple[str, ...]:
    """Every dotted field of ExecuTorch's LlmConfig (`export.max_seq_length`, ...)."""
    from executorch.extension.llm.export.config.llm_config import LlmConfig

    def walk(cls, prefix: str):
        for f in dataclasses.fields(cls):
            inner = getattr(f.default_factory, "__dataclass_fields__", None) and f.default_factory
            if inner:
                yield from walk(inner, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name
    return tuple(walk(LlmConfig, ""))


def _backends(section, out, problems):
    from .backends import BACKENDS, NOT_HERE

    if not isinstance(section, Mapping):
        problems.append(f"backend: expected a mapping of backends, got {section!r}")
        return
    chain = []
    for name, fields in section.items():
        if not isinstance(fields or {}, Mapping):
            problems.append(f"backend.{name}: expected a mapping of fields such as "
                            f"enabled: true, got {fields!r}")
            continue
        fields = dict(fields or {})
        if not fields.pop("enabled", False):
            continue
        backend = BACKENDS.get(name)
        if backend is None or backend.from_executorch is None:
            problems.append(f"backend.{name}: {NOT_HERE[name]()}" if name in NOT_HERE else
                            _no_backend(name, BACKENDS))
            continue
        chain.append(backend)
        options, recipes, found = backend.from_executorch(fields)
        problems.extend(found)
        for key, value in fields.items():  # what the backend did not take
            problems.append(_refused(f"backend.{name}.{key}", value))
        for field_name, (recipe, group) in recipes.items():
            _recipe(field_name, recipe, group, out, problems)
        if options:
            out[name] = options
    if chain:
        out["backends"] = [b.name for b in chain]
    _check_shapes(chain, out, problems)


def _no_backend(name: str, backends: dict) -> str:
    known = [n for n, b in backends.items() if b.from_executorch]
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    return f"backend.{name}: edgellm has no {name} backend.{hint} Supported: {', '.join(known)}"


def _check_shapes(chain, out, problems):
    """model.enable_dynamic_shape and model.use_sdpa_with_kv_cache against what the chain's
    programs are: they can only say what edgellm already does."""
    dynamic = out.pop("_dynamic", None)
    static = [b.name for b in chain if not b.dynamic_shapes]
    if dynamic is True and static:
        problems.append(f"model.enable_dynamic_shape: true, but {static[0]} programs take one "
                        "token per call (static shapes); set it to false")
    if dynamic is False and chain and not static:
        problems.append(f"model.enable_dynamic_shape: false is not supported for "
                        f"{','.join(b.name for b in chain)}; edgellm's programs for it take "
                        "1..max_seq_len tokens per call")
    custom = out.pop("_custom_sdpa", None)
    if custom is True and chain and not chain[0].custom_sdpa:
        problems.append(f"model.use_sdpa_with_kv_cache: true asks for ExecuTorch's "
                        f"llama::custom_sdpa, which {chain[0].name} cannot run; set it to false")
    if custom is False and chain and chain[0].custom_sdpa:
        problems.append(f"model.use_sdpa_with_kv_cache: false is not supported for "
                        f"{chain[0].name}; edgellm's programs for it use llama::custom_sdpa")


def output_folder(out: dict) -> None:
    """export.output_name NAME.pte (in export.output_dir) -> the output folder NAME, which
    holds model.pte beside its tokenizer, report and ETRecord."""
    name, folder = out.pop("_output_name", None), out.pop("_output_dir", None)
    if name is not None:
        path = Path(str(name))
        out["output"] = str(Path(folder or ".") / path.with_name(path.name.removesuffix(".pte")))
    elif folder is not None:
        out["output"] = str(Path(folder) / "edgellm-out")
