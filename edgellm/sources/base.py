"""What a source yields (`Source`): a transformers config, a state dict under Hugging Face names,
the tokenizer, and how the file stored each weight."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InputError


@dataclass
class Source:
    hf_config: object  # transformers.PretrainedConfig
    state_dict: dict
    origin: str  # what was read, for the report
    write_tokenizer: Callable[[Path], bool] = field(default=lambda out: False)  # -> written?
    tokenizer: Callable[[], object] = field(default=lambda: None)  # -> tokenizers.Tokenizer
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # how the file stored each HF parameter when it was quantized (GGUF: "Q4_1", "Q8_0", "F32")
    stored_types: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)  # lines the load stage says on stderr


def load_tokenizer(path: Path):
    """A tokenizer.json (or the one in folder `path`) as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"No tokenizer at {file}. Pass --tokenizer PATH/tokenizer.json; an "
                         "export writes one beside model.pte when the model folder has one.")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise InputError(f"{file} is not a readable tokenizer.json ({e}).") from None
