"""Hugging Face model folders: config.json, safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import InputError
from ..memory import note_mapped
from .base import Source

# copied beside the program: the tokenizer, its special tokens and the chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")


def read_config(folder: Path):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from ..architectures.registry import NAMES, architecture

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{folder} has no config.json. A Hugging Face model folder needs "
                         "config.json and *.safetensors; `save_pretrained` writes both.")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path} is not readable JSON ({e}). Restore it from the "
                         "model's original files.") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise InputError(f"{cfg_path} has no model_type. Supported: {', '.join(NAMES)}. Run "
                         "`edgellm models` to see every architecture and backend.")
    architecture(raw["model_type"])  # refuse unsupported types before transformers parses them
    try:
        cfg = AutoConfig.for_model(**raw)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        cause = getattr(e, "__cause__", None) or e
        raise InputError(f"{cfg_path} contradicts itself: {cause}. Fix config.json.") from None
    return cfg  # architecture-specific contradictions are checked when the model is built


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise InputError(f"{index} is not a valid safetensors index ({e}).") from None
        files = [folder / n for n in names]
        outside = [n for n, f in zip(names, files) if f.resolve().parent != folder.resolve()]
        if outside:
            raise InputError(f"{index} names shards outside the folder: {outside}.")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{index} lists shards that are missing: {', '.join(missing)}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder} has no *.safetensors weights. Save the model with "
                         "`save_pretrained(..., safe_serialization=True)`.")
    return files


def read_safetensors(files: list[Path]) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))  # memory-mapped
            note_mapped([f])
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise InputError(f"{f} is not a readable safetensors file ({e}). It may be "
                             "truncated: download or save it again.") from None
    return state


def transformers_names(model_type: str, state: dict) -> dict:
    """The state dict under the names transformers' modules use: the renamings transformers
    applies when it loads such a checkpoint (its conversion mapping: LFM3 stores its attention
    gate as gate_proj, the module is g_proj)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    rules = [r for r in get_checkpoint_conversion_mapping(model_type) or []
             if isinstance(r, WeightRenaming)]
    if not rules:
        return state
    out = {}
    for key, value in state.items():
        for rule in rules:
            key = rule.rename_source_key(key)[0]
        out[key] = value
    return out


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def load_hf_folder(folder: Path) -> Source:
    from ..architectures.registry import architecture

    cfg = read_config(folder)
    state = read_safetensors(weight_files(folder))
    tower, notes = architecture(cfg.model_type).tower, []
    if tower is not None:  # a multimodal folder: its text decoder is what exports
        folder_type, read = cfg.model_type, len(state)
        cfg, state = tower(cfg, state)
        if len(state) < read:
            notes.append(f"[edgellm] load: the text decoder of this {folder_type} folder exports; "
                         f"{read - len(state)} tensors of its other parts (vision tower, "
                         "projector, multi-token prediction) are left out")
    state = transformers_names(cfg.model_type, state)
    merge = architecture(cfg.model_type).merge
    if merge is not None:
        state = merge(cfg, state)
    eos = _ids(getattr(cfg, "eos_token_id", None))
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = _ids(json.loads(gen.read_text()).get("eos_token_id")) or eos
        except (OSError, json.JSONDecodeError, AttributeError):
            pass  # generation_config.json is optional; config.json's ids stand

    write, tokenizer = _folder_tokenizer(folder)
    return Source(hf_config=cfg, state_dict=state, origin=str(folder), write_tokenizer=write,
                  tokenizer=tokenizer, bos_id=getattr(cfg, "bos_token_id", None), eos_ids=eos,
                  notes=notes)


def _folder_tokenizer(folder: Path):
    """(write, load) for the folder's tokenizer files: copied beside the program when it has a
    tokenizer.json, which is read now, so an unreadable one is refused before any work."""
    if not (folder / "tokenizer.json").is_file():
        return (lambda out: False), (lambda: None)
    from .base import load_tokenizer

    tokenizer = load_tokenizer(folder / "tokenizer.json")

    def write(out: Path) -> bool:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
        return True

    return write, lambda: tokenizer


def tokenizer_files(path: Path):
    """(write, load) for a tokenizer given apart from the model: a tokenizer.json, or a folder
    holding one."""
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _folder_tokenizer(path)
    if path.is_file() and path.suffix == ".json":
        from .base import load_tokenizer

        tokenizer = load_tokenizer(path)
        return (lambda out: bool(shutil.copyfile(path, out / "tokenizer.json"))), (
            lambda: tokenizer)
    raise InputError(f"Tokenizer {path} is neither a tokenizer.json nor a folder holding one. "
                     "Give the tokenizer.json of a Hugging Face checkpoint.")
