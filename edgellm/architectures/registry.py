"""The architectures edgellm has, by Hugging Face model_type, and what each declares
(`Architecture`, `ExecuTorchLayout`, `GgufLayout`); the ExecuTorch model classes it refuses,
with why."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Callable

from ..errors import InputError

# HF model_type -> the module that defines its Architecture (as ARCHITECTURE, or among
# ARCHITECTURES where one module holds several)
MODULES = {"lfm2": "lfm2", "lfm3": "lfm3", "llama": "llama", "mistral": "mistral",
           "ministral": "mistral", "smollm3": "smollm3", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3", "granite": "granite",
           "olmo2": "olmo2", "qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5",
           "lfm2_moe": "lfm2_moe", "qwen3_moe": "qwen3_moe"}
NAMES = tuple(MODULES)
_MOE = ("a mixture-of-experts model edgellm has no architecture for; lfm2_moe and qwen3_moe "
        "export")
# HF model_types edgellm refuses, with why (anything else is simply unknown)
REFUSED_TYPES = {
    **dict.fromkeys(("qwen2_moe", "mixtral", "olmoe", "granitemoe",
                     "granitemoehybrid", "phimoe", "deepseek_v3", "gpt_oss"), _MOE),
    "qwen3_next": "Qwen3-Next (gated DeltaNet layers with mixture-of-experts feed-forwards): "
                  "edgellm has no qwen3_next architecture; Qwen3.5 (qwen3_5) exports",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp, LAuReL): edgellm has no gemma3n "
               "architecture; Gemma 3 (gemma3_text, or the text tower of a gemma3 folder) exports",
    **dict.fromkeys(("gemma4", "gemma4_text"), "Gemma 4: edgellm has no gemma4 architecture yet; "
                    "Gemma 3 exports"),
    "gemma2": "Gemma 2 (attention logit soft-capping, which neither llama::custom_sdpa nor SDPA "
              "takes): Gemma 3 exports",
    **dict.fromkeys(("lfm2_vl", "llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                     "mllama", "idefics3", "smolvlm", "paligemma", "mistral3", "phi4_multimodal"),
                    "a vision-language model: edgellm exports text decoders only (of the "
                    "multimodal folders, gemma3's text tower)"),
}
# llama.cpp's names (GGUF general.architecture) of refused model_types, where they differ
GGUF_REFUSED = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen2moe": "qwen2_moe",
                "gpt-oss": "gpt_oss", "qwen3next": "qwen3_next"}
# ExecuTorch base.model_class values edgellm refuses, with the reason
REFUSED_CLASSES = {
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
    reads: tuple[str, ...] = ()  # the params fields only some architectures read (Phi's RoPE)
    always_tied: str | None = None  # why the head must be the embedding, if it must


@dataclass(frozen=True)
class GgufLayout:
    """How llama.cpp's converter (conversion/*.py) writes an architecture into a GGUF, and what
    its loader keeps in code rather than in the file."""

    arch: str  # the file's general.architecture
    # GGUF keys (after "ARCH.") -> config fields, beyond the common ones (sources/gguf.py), for
    # an architecture transformers has no GGUF key table for
    keys: dict = field(default_factory=dict)
    permuted: bool = False  # q and k rows permuted (llama.cpp's LlamaModel and its subclasses)
    # (config dict so far, key(name, default) reading "ARCH.name", tensor names, values(name))
    # -> None: what transformers' tables leave out and llama.cpp keeps in code or in tensors
    fix: Callable | None = None
    # the architecture whose transformers tensor processor undoes the converter's changes, where
    # it is not `arch` (LFM2-MoE's squeezed conv kernels are LFM2's)
    processor: str | None = None


@dataclass(frozen=True)
class Architecture:
    model_type: str
    summary: str
    build: Callable  # (hf_config, ModelOptions, dtype) -> nn.Module on the meta device
    check: Callable = lambda cfg: []  # (hf_config) -> contradictions in the config
    unsupported: Callable = lambda cfg: []  # (hf_config) -> features of a valid config it lacks
    executorch: ExecuTorchLayout | None = field(default=None, repr=False)
    gguf: GgufLayout | None = field(default=None, repr=False)
    # a folder's (config, state dict) -> its text decoder's, which is what exports: a multimodal
    # folder's text tower, a text folder without its multi-token-prediction head
    tower: Callable | None = field(default=None, repr=False)
    # (config, state dict under transformers' names) -> the same with what transformers' loader
    # merges beyond names merged: mixture-of-experts layers' one tensor per expert stacked
    merge: Callable | None = field(default=None, repr=False)


def text_tensors(state_dict: dict, names: tuple) -> dict:
    """A multimodal folder's text decoder tensors (for `Architecture.tower`), renamed by prefix
    (`names`: (old prefix, new prefix), first match wins); the rest (a vision tower, a projector,
    a multi-token-prediction head) left out."""
    text = {}
    for key, value in state_dict.items():
        for old, new in names:
            if key.startswith(old):
                text[new + key[len(old):]] = value
                break
    return text


def architecture(model_type: str) -> Architecture:
    if model_type not in NAMES:
        why = f" ({REFUSED_TYPES[model_type]})" if model_type in REFUSED_TYPES else ""
        raise InputError(f"Unsupported model_type '{model_type}'{why}. Supported: "
                         f"{', '.join(NAMES)}. Run `edgellm models` to see every architecture "
                         "and backend.")
    module = importlib.import_module(f"{__package__}.{MODULES[model_type]}")
    return next(a for a in getattr(module, "ARCHITECTURES", (module.ARCHITECTURE,))
                if a.model_type == model_type)


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


def for_gguf(arch: str, path) -> Architecture:
    """The architecture of a GGUF's general.architecture; InputError saying why there is none
    (refused model_types by name, from the metadata alone)."""
    found = {a.gguf.arch: a for a in every() if a.gguf}
    if arch in found:
        return found[arch]
    if arch not in MODULES:
        architecture(GGUF_REFUSED.get(arch, arch))  # refused by name, with why where known
    raise InputError(f"{path} holds a '{arch}' model, which edgellm exports from its Hugging Face "
                     f"folder, not from a GGUF file; it reads GGUF files of {', '.join(found)} "
                     "(llama.cpp's names).")


# config.json sizes the families read: each must be a positive integer where the config has it
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window", "conv_L_cache", "query_pre_attn_scalar", "linear_conv_kernel_dim",
         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
         "linear_num_value_heads")
# factors that must be positive where set (Granite's multipliers, Gemma's soft cap)
FACTORS = ("rms_norm_eps", "norm_eps", "embedding_multiplier", "residual_multiplier",
           "attention_multiplier", "logits_scaling", "final_logit_softcapping")


def rope_parameter_sets(cfg) -> list[dict]:
    """The config's RoPE parameters: one dict, or one per layer type where the config keys them
    so (Gemma 3, LFM3)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


def config_problems(cfg) -> list[str]:
    """What in a transformers config no family can build, field by field: sizes that are not
    positive integers, factors that are not positive, heads that do not divide the width or each
    other, per-layer lists shorter than the layers. Checked before anything is built, so that a
    broken config.json is named instead of failing inside a layer."""
    out = []
    for name in SIZES:
        value = getattr(cfg, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            out.append(f"{name} is {value!r}; it must be a positive integer")
    for name in FACTORS:
        value = getattr(cfg, name, None)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            out.append(f"{name} is {value!r}; it must be a positive number")
    if out:
        return out
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
    if getattr(cfg, "head_dim", None) is None and cfg.hidden_size % heads:
        out.append(f"num_attention_heads {heads} does not divide hidden_size {cfg.hidden_size} "
                   "(and head_dim is not given)")
    if kv and heads % kv:
        out.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    for name in ("layer_types", "no_rope_layers"):
        value = getattr(cfg, name, None)
        if value is not None and len(value) < cfg.num_hidden_layers:
            out.append(f"{name} has {len(value)} entries for num_hidden_layers "
                       f"{cfg.num_hidden_layers}; one per layer is needed")
    for p in rope_parameter_sets(cfg):
        factor = p.get("partial_rotary_factor", 1.0)
        if not (isinstance(factor, (int, float)) and 0 < factor <= 1):
            out.append(f"partial_rotary_factor is {factor!r}; it must be in (0, 1]")
    return out


def layer_kinds(p: dict, allowed: tuple[str, ...]) -> list[str]:
    """Problems with params' `layer_types` (ExecuTorch reads layer_types[i] for i < n_layers:
    the upstream lfm2_350m/700m/1_2b JSONs list 17 kinds for 16 layers and the 17th is never
    read; fewer than n_layers would crash)."""
    kinds, n = p["layer_types"] or [], p["n_layers"]
    odd = sorted(set(kinds[:n]) - set(allowed))
    return ([f"layer_types has {len(kinds)} entries for n_layers {n}; one kind per layer is "
             "needed"] if len(kinds) < n else []) + (
        [f"layer_types holds {odd}; allowed: {', '.join(allowed)}"] if odd else [])
