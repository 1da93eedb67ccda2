"""The one place weights are loaded: a model built for its config on the meta device, then every
tensor of the state dict assigned by name, without copies, after the model's own load-time hooks
(`state_dict_hooks`: layout changes converted in one place). Missing, unexpected and mis-shaped
tensors fail the load, named.

A state dict may hold tensors not read yet: `moe.Deferred` (mixture-of-experts stacks) and
`Pending` (a GGUF's matrices, still quantized in the mapped file). They are read into the model's
dtype as they load, or, with `defer` (an export whose recipe replaces them), left in the
checkpoint: the owning module's `defer` keeps a `Deferred` for whoever replaces it, and a `Pending`
stays on its meta Parameter (`pending`) until quantization reads it (`read_pending`), one weight at
a time, so the float model is never whole; `load_pending` reads what no recipe replaced, and
`load_deferred` reads them all for a consumer of the float model (verification). The model's
load-time hooks (splits, folds, fusions) turn a pending weight into a pending result
(`pending.derive`): nothing is read at load."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from .registry import architecture, config_problems
from .layers import ModelOptions, separate_tied_head
from .pending import Pending


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
    them. With `defer`, values not read yet (not tensors) stay so: a `Pending` on a meta
    Parameter of its shape, a `moe.Deferred` handed to its module's `defer`."""
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
            value, module = state_dict.pop(key), model.get_submodule(owner)
            if isinstance(value, Pending):
                param = nn.Parameter(torch.empty(value.shape, dtype=dtype, device="meta"),
                                     requires_grad=False)
                param.pending = value
                setattr(module, name, param)
            else:
                module.defer(name, value, dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=False,
                          assign=True)


def read_pending(module: nn.Module, name: str = "weight", read: dict | None = None,
                 unless_by_rows: bool = False) -> None:
    """`module.name` read from the checkpoint now if it was left pending (`read`: the pending
    values read so far, by identity, so that a tied head and its table read once share it;
    `unless_by_rows`: left pending where it can be read a block of rows at a time)."""
    param = getattr(module, name)
    value = getattr(param, "pending", None)
    if value is None or unless_by_rows and value.by_rows:
        return
    tensor = None if read is None else read.get(id(value))
    if tensor is None:
        tensor = nn.Parameter(value.to(param.dtype), requires_grad=False)
        if read is not None:
            read[id(value)] = tensor
    setattr(module, name, tensor)


def load_pending(model: nn.Module) -> None:
    """Every pending weight no recipe replaced read into the model now (tied ones shared)."""
    read: dict = {}
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if getattr(param, "pending", None) is not None:
                read_pending(module, name, read)


def load_deferred(model: torch.nn.Module) -> None:
    """Every tensor `defer` left in the checkpoint read into the model now."""
    load_pending(model)
    for module in model.modules():
        if getattr(module, "deferred", None):
            module.load_deferred()


def _names(items: list[str], limit: int = 8) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
