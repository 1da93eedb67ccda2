"""Architectures: one file per Hugging Face `model_type`, each holding everything about it.

An architecture module defines `ARCHITECTURE`, an `Architecture`: how to build it from a
transformers config (parameters on the meta device, Hugging Face names, state buffers real),
what in a config contradicts itself or is not supported, and, where ExecuTorch's `export_llm`
has it, how its `.pth` checkpoints and params JSON map onto the same (`ExecuTorchLayout`). A
module's forward is `forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]` for the last token.
Adding a Llama-layout family is one small file (`llama.relative`) and its name in NAMES.

registry.py lists them; weights load in one place, loading.py; layers.py holds what several
architectures share.
"""

from __future__ import annotations

from .loading import build_model, load_deferred, load_pending, load_weights, read_pending
from .registry import (NAMES, Architecture, ExecuTorchLayout, architecture, every,
                       for_model_class, layer_kinds)

__all__ = ["NAMES", "Architecture", "ExecuTorchLayout", "architecture", "build_model", "every",
           "for_model_class", "layer_kinds", "load_deferred", "load_pending", "load_weights",
           "read_pending"]
