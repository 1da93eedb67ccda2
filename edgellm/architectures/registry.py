"""The architectures edgellm has, by Hugging Face model_type, and what each declares
(`Architecture`, `ExecuTorchLayout`); the ExecuTorch model classes it refuses, with why."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Callable

from ..errors import InputError

NAMES = ("lfm2", "llama", "qwen2", "qwen3")  # the architecture modules, by HF model_type
# ExecuTorch base.model_class values edgellm refuses, with the reason
REFUSED_CLASSES = {
    **dict.fromkeys(("qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b"), "Qwen3.5 (gated DeltaNet "
                    "linear-attention layers): edgellm has no qwen3_5 architecture yet"),
    "phi_4_mini": "Phi-4-mini (partial rotary, LongRoPE): edgellm has no phi3 architecture yet",
    "llama3_2_vision": "a torchtune multimodal decoder: edgellm has no vision architecture",
    "static_llama": "Qualcomm's static-shape wrapper, not a weights layout: give the class the "
                    "checkpoint was trained as (e.g. llama3_2)"}


@dataclass(frozen=True)
class ExecuTorchLayout:
    """How ExecuTorch's export_llm holds an architecture: its `base.model_class` names, its
    parameter names (Meta's, from llama_transformer.py) and its params JSON (ModelArgs)."""

    model_classes: tuple[str, ...]
    layer_names: dict  # Meta name -> HF name, inside "layers.N." on both sides
    final_norm: str  # the HF name of Meta's "norm.weight"
    # (params resolved as ModelArgs does, model_class) -> what this architecture cannot take
    problems: Callable[[dict, str], list[str]]
    # (params, model_class, fields every config shares, tied head) -> a transformers config
    config: Callable[[dict, str, dict, bool], object]
    # Meta state dict -> the same with tensors Meta splits joined back (LFM2's conv in_proj)
    join: Callable[[dict], dict] = lambda sd: sd
    qkv_bias: bool = False  # it takes attention_qkv_bias (biases on q, k and v)
    always_tied: str | None = None  # why the head must be the embedding, if it must


@dataclass(frozen=True)
class Architecture:
    model_type: str
    summary: str
    build: Callable  # (hf_config, ModelOptions, dtype) -> nn.Module on the meta device
    check: Callable = lambda cfg: []  # (hf_config) -> contradictions in the config
    unsupported: Callable = lambda cfg: []  # (hf_config) -> features of a valid config it lacks
    executorch: ExecuTorchLayout | None = field(default=None, repr=False)


def architecture(model_type: str) -> Architecture:
    if model_type not in NAMES:
        raise InputError(f"Unsupported model_type '{model_type}'. Supported: {', '.join(NAMES)}. "
                         "Run `edgellm models` to see every architecture and backend.")
    return importlib.import_module(f"{__package__}.{model_type}").ARCHITECTURE


def every() -> list[Architecture]:
    return [architecture(name) for name in NAMES]


def for_model_class(model_class: str) -> Architecture:
    """The architecture of an ExecuTorch base.model_class; InputError saying why there is none."""
    classes = {c: a for a in every() if a.executorch for c in a.executorch.model_classes}
    if model_class in classes:
        return classes[model_class]
    supported = f"Supported: {', '.join(classes)}."
    if model_class in REFUSED_CLASSES:
        raise InputError(f"ExecuTorch model_class '{model_class}' is not supported: "
                         f"{REFUSED_CLASSES[model_class]}. {supported}")
    close = difflib.get_close_matches(str(model_class), classes, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise InputError(f"Unknown ExecuTorch model_class '{model_class}'.{hint} {supported} "
                     "Run `edgellm models` to see every architecture.")


def layer_kinds(p: dict, allowed: tuple[str, ...]) -> list[str]:
    """Problems with params' `layer_types` (ExecuTorch reads layer_types[i] for i < n_layers:
    the upstream lfm2_350m/700m/1_2b JSONs list 17 kinds for 16 layers and the 17th is never
    read; fewer than n_layers would crash)."""
    kinds, n = p["layer_types"] or [], p["n_layers"]
    odd = sorted(set(kinds[:n]) - set(allowed))
    return ([f"layer_types has {len(kinds)} entries for n_layers {n}; one kind per layer is "
             "needed"] if len(kinds) < n else []) + (
        [f"layer_types holds {odd}; allowed: {', '.join(allowed)}"] if odd else [])
