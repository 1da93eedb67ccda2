"""Architectures, one file per Hugging Face `model_type`, and the one place weights are loaded.

Each architecture module defines `build(hf_config, opts, dtype) -> nn.Module` (parameters on the
meta device, state buffers real) and `check(hf_config) -> list[str]` (contradictions in the config);
optionally `unsupported(hf_config) -> list[str]` (features of a valid config it does not build).
The module's forward is `forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]` for the last token.
"""

from __future__ import annotations

import importlib

import torch

from ..errors import InputError
from .layers import ModelOptions, separate_tied_head

ARCHITECTURES = {"lfm2": "LFM2 and LFM2.5 (short-conv + attention hybrids)",
                 "llama": "Llama 3.x, SmolLM2 and other Llama-layout models",
                 "qwen2": "Qwen2 and Qwen2.5 (Llama layout with q, k and v biases)",
                 "qwen3": "Qwen3 dense models (Llama layout with per-head q and k norms)"}


def architecture(model_type: str):
    if model_type not in ARCHITECTURES:
        raise InputError(f"Unsupported model_type '{model_type}'. Supported: "
                         f"{', '.join(ARCHITECTURES)}. Run `edgellm models` to see every "
                         "architecture and backend.")
    return importlib.import_module(f"{__name__}.{model_type}")


def build_model(hf_config, state_dict: dict, opts: ModelOptions, dtype: torch.dtype):
    """Build the architecture for `hf_config` and load `state_dict` into it without copies."""
    arch = architecture(hf_config.model_type)
    problems = arch.check(hf_config)
    if problems:
        raise InputError(f"config.json contradicts itself: {'; '.join(problems)}. "
                         "Fix the checkpoint's config.json.")
    unsupported = getattr(arch, "unsupported", lambda cfg: [])(hf_config)
    if unsupported:
        raise InputError(f"config.json asks for what edgellm cannot export: "
                         f"{'; '.join(unsupported)}.")
    model = arch.build(hf_config, opts, dtype)
    load_weights(model, state_dict, dtype)
    if opts.separate_head:
        separate_tied_head(model)
    return model.eval()


def load_weights(model: torch.nn.Module, state_dict: dict, dtype: torch.dtype) -> None:
    """Assign every tensor by name; fail on missing, unexpected or mis-shaped tensors, naming them."""
    state_dict = dict(state_dict)
    for hook in getattr(model, "state_dict_hooks", ()):
        hook(state_dict)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    shapes = sorted(f"{k} {tuple(state_dict[k].shape)} (expected {tuple(p.shape)})"
                    for k, p in expected.items()
                    if k in state_dict and tuple(state_dict[k].shape) != tuple(p.shape))
    problems = [f"{what}: {_names(items)}" for what, items in
                (("missing tensors", missing), ("unexpected tensors", unexpected),
                 ("mis-shaped tensors", shapes)) if items]
    if problems:
        raise InputError(f"Checkpoint does not fit the {type(model).__name__} its config "
                         f"describes: {'; '.join(problems)}. Check that the weights and "
                         "config.json come from the same model.")
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=False,
                          assign=True)


def _names(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
