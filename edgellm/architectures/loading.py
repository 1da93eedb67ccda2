"""The one place weights are loaded: a model built for its config on the meta device, then every
tensor of the state dict assigned by name, without copies, after the model's own load-time hooks
(`state_dict_hooks`: layout changes converted in one place). Missing, unexpected and mis-shaped
tensors fail the load, named.

A state dict may hold tensors not read yet (`moe.Deferred`: mixture-of-experts stacks). They are
read into the model's dtype as they load, or, with `defer` (an export whose recipe replaces them),
left in the checkpoint: the owning module's `defer` keeps them for whoever replaces them, and
`load_deferred` reads them all for a consumer of the float model (verification)."""

from __future__ import annotations

import torch

from ..errors import InputError
from .registry import architecture, config_problems
from .layers import ModelOptions, separate_tied_head


def build_model(hf_config, state_dict: dict, opts: ModelOptions, dtype: torch.dtype,
                defer: bool = False):
    """Build the architecture for `hf_config` and load `state_dict` into it without copies
    (`defer`: tensors not read yet stay in the checkpoint, as load_weights says)."""
    arch = architecture(hf_config.model_type)
    fields = config_problems(hf_config)
    if fields:
        raise InputError(f"config.json cannot describe a model: {'; '.join(fields)}. Fix the "
                         "checkpoint's config.json.")
    problems = arch.check(hf_config)
    if problems:
        raise InputError(f"config.json contradicts itself: {'; '.join(problems)}. "
                         "Fix the checkpoint's config.json.")
    unsupported = arch.unsupported(hf_config)
    if unsupported:
        raise InputError(f"config.json asks for what edgellm cannot export: "
                         f"{'; '.join(unsupported)}.")
    model = arch.build(hf_config, opts, dtype)
    load_weights(model, state_dict, dtype, defer)
    if opts.separate_head:
        separate_tied_head(model)
    return model.eval()


def load_weights(model: torch.nn.Module, state_dict: dict, dtype: torch.dtype,
                 defer: bool = False) -> None:
    """Assign every tensor by name; fail on missing, unexpected or mis-shaped tensors, naming
    them. With `defer`, values not read yet (not tensors: `moe.Deferred`) are handed to their
    module's `defer` instead."""
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
        family = getattr(model, "family", type(model).__name__)
        raise InputError(f"Checkpoint does not fit the {family} model its config describes: "
                         f"{'; '.join(problems)}. Check that the weights and config.json come "
                         "from the same model.")
    if defer:
        for key in [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]:
            owner, name = key.rsplit(".", 1)
            model.get_submodule(owner).defer(name, state_dict.pop(key), dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=False,
                          assign=True)


def load_deferred(model: torch.nn.Module) -> None:
    """Every tensor `defer` left in the checkpoint read into the model now."""
    for module in model.modules():
        if getattr(module, "deferred", None):
            module.load_deferred()


def _names(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
