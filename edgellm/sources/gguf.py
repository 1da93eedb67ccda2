"""GGUF files, read through transformers' GGUF support (which uses the `gguf` package): weights
dequantized to float32 under Hugging Face names, the config, the tokenizer converted to a
tokenizer.json, and each weight's GGUF storage type (`Q4_1`, `Q8_0`, ...), which 4-bit recipes
read to keep the file's own grids and precision choices (quantize/plan.py, quantize/grid.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..errors import InputError
from .base import Source


def _pre_tokenizer_fix(kind: str):
    """transformers maps some llama.cpp pre-tokenizers to plain GPT-2 byte-level splitting.
    llama.cpp's `smollm` isolates every digit first; without this, non-ASCII numerals tokenize
    differently from llama.cpp."""
    from tokenizers import pre_tokenizers

    if kind == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return None


def _read(path: Path, **kwargs) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        return load_gguf_checkpoint(str(path), **kwargs)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise InputError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}). It may "
                         "be truncated or of an unsupported GGUF version: download it again.") \
            from None


def load_gguf(path: Path) -> Source:
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..architectures.registry import architecture

    meta = _read(path)
    raw = {k: v for k, v in meta["config"].items() if k != "_model_name_or_path"}
    architecture(raw.get("model_type", "?"))  # refuse unsupported architectures early
    reader = gguf.GGUFReader(str(path))  # tensor types and fields transformers does not map
    head_dim = _key_length(reader)
    if head_dim is not None and "head_dim" not in raw:
        raw["head_dim"] = head_dim
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):  # the skeleton only tells transformers the names to map to
        skeleton = AutoModelForCausalLM.from_config(cfg)
    state = _read(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    stored = _stored_types(reader, meta["config"], skeleton)
    tok = meta.get("tokenizer", {})

    @functools.cache
    def converted():
        """The file's tokenizer as transformers converts it, once (it reads the file again)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        fix = _pre_tokenizer_fix(tok.get("pre_tokenizer_type", ""))
        if fix is not None:
            tokenizer.backend_tokenizer.pre_tokenizer = fix
        return tokenizer

    def write_tokenizer(out: Path) -> bool:
        converted().save_pretrained(str(out))
        return (out / "tokenizer.json").is_file()

    eos = tok.get("eos_token_id", getattr(cfg, "eos_token_id", None))
    return Source(hf_config=cfg, state_dict=state, origin=str(path),
                  write_tokenizer=write_tokenizer,
                  tokenizer=lambda: converted().backend_tokenizer, bos_id=tok.get("bos_token_id"),
                  eos_ids=() if eos is None else (int(eos),), stored_types=stored)


def _key_length(reader) -> int | None:
    """The file's `ARCH.attention.key_length` (the head width), which transformers' GGUF config
    map leaves out for some architectures (qwen3: the config then takes Qwen3Config's default of
    128, and a model of other heads loads mis-shaped)."""
    fields = reader.fields
    arch = fields.get("general.architecture")
    found = arch is not None and fields.get(f"{arch.contents()}.attention.key_length")
    return int(found.contents()) if found else None


def _stored_types(reader, config: dict, skeleton) -> dict:
    """HF parameter name -> GGUF tensor type name, through transformers' own name mapping."""
    from transformers.modeling_gguf_pytorch_utils import (TensorProcessor,
                                                          get_gguf_hf_weights_map)

    names = get_gguf_hf_weights_map(skeleton, TensorProcessor(config=config))
    return {names[t.name]: t.tensor_type.name for t in reader.tensors
            if t.name in names}
