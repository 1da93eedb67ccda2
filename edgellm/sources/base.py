"""What a source yields (`Source`): a transformers config, a state dict under Hugging Face names,
the tokenizer, and how the file stored each weight."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


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
