"""User choices as frozen dataclasses: YAML files, `key=value` overrides, one validation pass.

A config file is a flat mapping of ExportConfig fields plus one section per backend for that
backend's own options (`coreml: {min_ios: 18}`). Overrides use dotted keys (`coreml.min_ios=17`)
and YAML values. Validation collects every problem and raises one ConfigError listing them all.
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
from .quantize import problems as quantize_problems

DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class ExportConfig:
    model: str | None = None  # HF folder, .gguf or ExecuTorch .pth; None: the embedded default
    output: str = "edgellm-out"
    backends: tuple[str, ...] = ("xnnpack",)
    max_seq_len: int = 128  # longest T one forward call takes
    max_context_len: int | None = None  # KV cache length; defaults to max_seq_len
    prefill_chunk: int = 0  # >0: also a `prefill` method taking this many tokens per call
    dtype: str = "fp32"
    quantize: str | None = None  # linear weight recipe (quantize.RECIPES): 8da4w, 8da8w, 4w, 8w
    group_size: int | None = None  # quantization group along the input dim; 0: per channel
    embedding_quantize: str | None = None  # embedding tables: "BITS[,GROUP]", e.g. "8", "4,32"
    etrecord: bool = False
    verify: bool = True  # check the program against the checkpoint at the end (verification.py)
    force: bool = False
    params: str | None = None  # ExecuTorch params JSON, describing a .pth model
    model_class: str | None = None  # ExecuTorch model class of a .pth model, e.g. lfm2_5_350m
    tokenizer: str | None = None  # tokenizer.json (or its folder) to ship instead of the model's
    bos_id: int | None = None  # override the checkpoint's BOS id
    eos_ids: tuple[int, ...] | None = None  # override the checkpoint's EOS ids
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
            hint = difflib.get_close_matches(key, known, n=1)
            more = f" Did you mean '{hint[0]}'?" if hint else f" Known: {', '.join(known)}."
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
    from .backends import BACKENDS, check_chain

    if not isinstance(data, Mapping):
        raise ConfigError([f"a config must be a mapping of keys to values, got {type(data).__name__}"])
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
        problems.extend(check_chain(cfg.backends))
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


def _problems(cfg: ExportConfig) -> list[str]:
    out = []
    if cfg.dtype not in DTYPES:
        out.append(f"dtype: '{cfg.dtype}' is not one of {', '.join(DTYPES)}")
    out.extend(quantize_problems(cfg))
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


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value). The value is read as YAML; a leading '+' is ignored."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([f"override '{text}' is not of the form key=value (e.g. max_seq_len=256)"])
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
