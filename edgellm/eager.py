"""The eager model an export lowers and `verify` checks, made the same way for both: load the
source, build the architecture for the chain's first backend, quantize.

Each stage hands its product to `made(stage, product)` as soon as it exists: ("load", Source),
("build", the model before quantization), ("quantize", the quantized model). Whoever needs a
product at that moment takes it there (verification runs transformers beside the built model,
before quantization changes it in place); nothing else is kept alive for it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from .config import ExportConfig, torch_dtype
from .errors import InputError
from .memory import drop_checkpoint_pages
from .progress import Stages


@dataclass
class Eager:
    source: object  # sources.Source; its state dict emptied once the model holds the tensors
    model: object  # the eager module, quantized as the program will be
    quantized: object | None  # quantize.apply.Quantized, None without a recipe
    weight_bytes: int  # of weights one decode step reads
    parameters: dict  # {"total", "per_token"}: the model's, and those one decode step reads
    state: dict  # what the program keeps between calls, per layer (cache.state_report)
    kv_cache: dict  # the KV caches alone (cache.kv_cache_report)

    @property
    def weights_read(self) -> dict:
        """report.json's weight_bytes_per_token and parameters."""
        return {"weight_bytes_per_token": self.weight_bytes, "parameters": self.parameters}


def eager_model(cfg: ExportConfig, plan, stages: Stages,
                made: Callable[[str, object], None] = lambda stage, product: None) -> Eager:
    """Load, build and quantize as `cfg` and the backends' `plan` ask, one timed stage each."""
    import torch

    from .architectures import build_model, load_pending
    from .architectures.cache import kv_cache_report, state_report
    from .architectures.layers import storage, weight_bytes
    from .sources import load_source

    with stages.stage("load"):
        # without verification, which holds the float model whole, a recipe reads a GGUF's
        # matrices one at a time as it quantizes them (pending.Pending)
        source = load_source(cfg.model, params=cfg.params, model_class=cfg.model_class,
                             tokenizer=cfg.tokenizer, lazy=bool(cfg.quantize) and not cfg.verify)
        source.bos_id = source.bos_id if cfg.bos_id is None else cfg.bos_id
        source.eos_ids = source.eos_ids if cfg.eos_ids is None else cfg.eos_ids
    for line in [] if stages.quiet else source.notes:
        print(line, file=sys.stderr, flush=True)
    made("load", source)
    trained = getattr(source.hf_config, "max_position_embeddings", None)
    if trained and cfg.context_len > trained and not cfg.allow_long_context:
        raise InputError(f"A context of {cfg.context_len} is beyond the {trained} positions "
                         f"the model was trained for (max_position_embeddings); past them its "
                         "output is not what it was trained to give. Lower --max-context-len "
                         "(or --max-seq-len), or pass --allow-long-context to export it anyway.")
    opts = plan.model_options(cfg, source.stored_types)
    quantizing = bool(cfg.quantize or cfg.embedding_quantize)
    with stages.stage("build"):  # what a recipe replaces (experts) is read when it does
        model = build_model(source.hf_config, source.state_dict, opts, torch_dtype(cfg.dtype),
                            defer=bool(cfg.quantize))
    if cfg.memory_budget is not None:  # the state alone, before verification's reference runs
        check_budget(cfg, None if quantizing else weight_bytes(model), state_report(model),
                     kv_cache_report(model))
    if cfg.quantize and cfg.experts == "every":  # counted as read: every expert will run
        from .architectures.moe import SparseMoE

        for block in (m for m in model.modules() if isinstance(m, SparseMoE)):
            block.reads_every = True
    made("build", model)
    source.state_dict = {}  # the model holds the tensors now
    drop_checkpoint_pages()  # pages of checkpoint weights the build replaced
    weights = weight_bytes(model)
    unique = {storage(p): p for p in model.parameters()}.values()  # tied ones once
    parameters = {"total": sum(p.numel() for p in unique),
                  "per_token": weight_bytes(model, torch.Tensor.numel)}
    done = None
    if quantizing:
        from .quantize import quantize

        with stages.stage("quantize"):
            first = plan.backends[0]
            refused = first.quantized_experts and f"{first.name}: {first.quantized_experts}"
            done = quantize(model, cfg, source.stored_types, refused)
            load_pending(model)  # what the recipe left in float
        drop_checkpoint_pages()  # and those quantization replaced
        weights -= done.bytes_saved
        for line in [] if stages.quiet else done.notes():
            print(line, file=sys.stderr, flush=True)
        made("quantize", model)
    state, kv = state_report(model), kv_cache_report(model)
    if cfg.memory_budget is not None and quantizing:
        check_budget(cfg, weights, state, kv)
    return Eager(source, model, done, weights, parameters, state, kv)


def check_budget(cfg: ExportConfig, weights: int | None, state: dict, kv: dict) -> None:
    """Refuse a program whose weights (those a decode step reads; None: not known yet, before a
    recipe) and state (caches at the full context, conv and recurrent states) exceed
    `cfg.memory_budget`, before anything is exported: with what it would take, the longest
    context that fits and what an int8 cache would take. Activations come on top (a few MB for
    a decode step)."""
    from .config import parse_size

    budget, need = parse_size(cfg.memory_budget), (weights or 0) + state["bytes"]
    if need <= budget:
        return
    full = sum(r["bytes_per_position"] for r in kv["layers"] if r["slots"] == cfg.context_len)
    fixed = state["bytes"] - full * cfg.context_len  # rings, conv and recurrent states
    fits = (budget - (weights or 0) - fixed) // full if full else 0
    advice = [f"lower --max-context-len to {fits} (the longest that fits)" if fits > 0 else
              "choose a smaller model or a 4-bit recipe (--quantize)"]
    if not cfg.kv_cache and kv["layers"]:  # what int8 rows of D values, a scale and a zero cost
        d = kv["layers"][0]["k_cache"][-1]
        int8 = sum(r["bytes"] for r in kv["layers"]) * (d + 5) // (d * {"float32": 4}.get(
            kv["dtype"], 2))
        advice.append(f"--kv-cache int8 (caches of {size(int8)} instead of "
                      f"{size(kv['bytes'])}, on xnnpack and portable)")
    parts = "" if weights is None else f"{size(weights)} of weights and "
    raise InputError(f"A context of {cfg.context_len} needs {size(need)}"
                     f"{' before its weights' if weights is None else ''}: {parts}"
                     f"{size(state['bytes'])} of state ({size(kv['bytes'])} of "
                     f"{kv['dtype']} KV caches), over --memory-budget {cfg.memory_budget}. Either "
                     f"{' or '.join(advice)}.")


def size(n: int) -> str:
    """Bytes in binary units, as memory is sold (config.parse_size reads them)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
