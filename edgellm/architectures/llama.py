"""Llama 3.x and SmolLM2 (transformers `model_type: llama`), written for export.

Same math and parameter names as transformers' LlamaForCausalLM; rotary frequencies (including
Llama 3 rope scaling) come from transformers itself. Differences: a static KV cache per layer,
and only the last token's logits are computed.

The Llama layout's relatives (qwen2.py, qwen3.py) are a `Variant` of these classes and share the
ExecuTorch side below: Meta's names (llama_transformer.py) and the params checks of a model whose
every layer is attention. ExecuTorch scales RoPE only on its own path (use_hf_rope false), as
Llama 3 does; its q/k rows are then interleaved, which sources/executorch.py undoes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .cache import KVCache
from .moe import SparseMoE, fold_into_experts
from .pending import derive
from .layers import (FULL, ModelOptions, RMSNorm, Rope, fold_norm, fuse_qk_weights, fused_qk,
                     head_weight, run_decoder, split_heads)
from .registry import (Architecture, ExecuTorchLayout, GgufLayout, layer_kinds,
                       rope_parameter_sets)


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window as transformers applies it, None for full attention: every
    layer when the config has a window and no layer_types (Mistral, Phi-3), the
    "sliding_attention" layers otherwise (Gemma 3, Ministral, LFM3, and Qwen or SmolLM3 with
    use_sliding_window)."""
    window, n = getattr(cfg, "sliding_window", None), cfg.num_hidden_layers
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:
        return [window] * n
    return [window if kind == "sliding_attention" else None for kind in kinds[:n]]


def hf_ropes(cfg, rotary: str, opts: ModelOptions) -> dict:
    """The rotary tables transformers computes for cfg, from its own class (`rotary`:
    "module:Class" under transformers.models): one, or one per layer type where the config
    gives each its own RoPE (Gemma 3, LFM3). LongRoPE positions from the original context on
    use the long factors (transformers switches every position once the sequence passes it)."""
    import importlib

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    module, name = rotary.split(":")
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    with torch.device("cpu"):
        hf = cls(cfg)
    kinds = [k for k in (FULL, "sliding_attention") if hasattr(hf, f"{k}_inv_freq")]
    out = {}
    for kind in kinds or [FULL]:
        prefix, layer = (f"{kind}_", kind) if kinds else ("", None)
        params = cfg.rope_parameters[layer] if layer else cfg.rope_parameters
        long = None
        if params.get("rope_type") == "longrope":
            first = params["original_max_position_embeddings"]
            inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=first + 1,
                                                     **({"layer_type": layer} if layer else {}))
            long = (inv, first)
        with torch.device("cpu"):
            out[kind] = Rope(getattr(hf, f"{prefix}inv_freq"),
                             getattr(hf, f"{prefix}attention_scaling"), opts.max_context_len,
                             opts.rope, head_dim=head_dim(cfg), long=long)
    return out


@dataclass(frozen=True)
class Variant:
    """What Llama-layout relatives change in the layout itself (what they change in numbers, the
    config says: windows, multipliers, scales, RoPE).

    qkv_bias: biases on q, k and v, not o (Qwen2). qk_norm: an RMSNorm over each head of q and k
    before RoPE ("head": Qwen3, Gemma 3) or over the whole q and k projections ("whole": OLMo 2).
    norms: where the block's norms sit, by their transformers names (NORMS). norm_offset: norm
    weights stored as w - 1 (Gemma). fused: qkv_proj and gate_up_proj in the checkpoint (Phi-3),
    split by rows at load time. embed_sqrt: embeddings scaled by sqrt(hidden) (Gemma). rotary:
    transformers' class that computes the RoPE tables."""

    qkv_bias: bool = False
    qk_norm: str | None = None
    norms: str = "pre"
    norm_offset: bool = False
    fused: bool = False
    embed_sqrt: bool = False
    # a sigmoid gate on the attention output, computed from the block's input by `g_proj`:
    # "head", one per head (LFM3); "element", one per output element (Qwen3.5)
    gate: str | None = None
    rotary: str = "llama.modeling_llama:LlamaRotaryEmbedding"
    # (config, layer index) -> that layer's feed-forward where it is not the MLP, else None
    # (Qwen3-MoE's sparse blocks, moe.SparseMoE)
    ffn: Callable | None = None


# norm slot -> transformers' name, per layout: before or after the attention and feed-forward
NORMS = {"pre": {"attn_pre": "input_layernorm", "ffn_pre": "post_attention_layernorm"},
         "sandwich": {"attn_pre": "input_layernorm", "attn_post": "post_attention_layernorm",
                      "ffn_pre": "pre_feedforward_layernorm",
                      "ffn_post": "post_feedforward_layernorm"},
         "post": {"attn_post": "post_attention_layernorm",
                  "ffn_post": "post_feedforward_layernorm"}}
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(cfg) -> str:
    return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")


def attention_scale(cfg) -> float | None:
    """SDPA's scale where the config replaces 1/sqrt(head_dim): Gemma's query_pre_attn_scalar,
    Granite's attention_multiplier."""
    if getattr(cfg, "query_pre_attn_scalar", None):
        return float(cfg.query_pre_attn_scalar) ** -0.5
    return getattr(cfg, "attention_multiplier", None)


def unsupported(cfg) -> list[str]:
    """What a valid config of a Llama-layout family may ask that these classes do not do."""
    out = []
    if activation(cfg) not in ACTIVATIONS:
        out.append(f"hidden_act '{activation(cfg)}' (supported: {', '.join(ACTIVATIONS)})")
    if getattr(cfg, "attn_logit_softcapping", None):
        out.append("attn_logit_softcapping (a soft cap inside attention, which neither "
                   "llama::custom_sdpa nor SDPA takes)")
    if getattr(cfg, "use_bidirectional_attention", False):
        out.append("use_bidirectional_attention (an encoder, not a decoder)")
    for p in rope_parameter_sets(cfg):
        if "dynamic" in str(p.get("rope_type", "")):
            out.append(f"rope_type '{p['rope_type']}' (its tables change with the sequence "
                       "length; a program's are fixed)")
    return out


class Attention(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant, window: int | None,
                 rope: str | None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, head_dim(cfg))
        self.rope_kind = rope  # the Step.ropes entry this layer rotates with; None: no RoPE
        bias = getattr(cfg, "attention_bias", False)
        qkv_bias, hd, eps = bias or variant.qkv_bias, self.head_dim, cfg.rms_norm_eps
        self.qk_norm = variant.qk_norm
        self.fused = self.qk_norm == "head" and opts.fuse_qk and not qkv_bias  # layers.fused_qk
        if self.fused:
            self.qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + self.n_kv) * hd, bias=False)
            self.qk_layernorm = RMSNorm(hd, eps, opts.norm, affine=False)
            self.qk_weight = nn.Parameter(torch.empty(self.n_heads + self.n_kv, 1, hd))
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=qkv_bias)
            self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        if self.qk_norm and not self.fused:
            whole = self.qk_norm == "whole"
            self.q_norm = RMSNorm(hd * (self.n_heads if whole else 1), eps, opts.norm)
            self.k_norm = RMSNorm(hd * (self.n_kv if whole else 1), eps, opts.norm)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=bias)
        self.gate = variant.gate
        if self.gate:
            width = self.n_heads * (hd if self.gate == "element" else 1)
            self.g_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        with torch.device("cpu"):
            self.cache = KVCache(self.n_heads, self.n_kv, self.head_dim, opts, dtype, window,
                                 attention_scale(cfg))
        self.cache.rope_kind = rope  # what its sink keys rotate with (attention sinks)

    def forward(self, x, step):
        rope = step.ropes[self.rope_kind] if self.rope_kind else None
        if self.fused:
            v = split_heads(self.v_proj(x), self.n_kv, self.head_dim, step)
            q, k = fused_qk(self, x, step, rope)
            return self.o_proj(self._gated(self.cache(q, k, v, step), x))
        q = self._heads("q", x, self.n_heads, step)
        k = self._heads("k", x, self.n_kv, step)
        v = split_heads(self.v_proj(x), self.n_kv, self.head_dim, step)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q), rope(k)
        return self.o_proj(self._gated(self.cache(q, k, v, step), x))

    def _heads(self, which: str, x, n: int, step):
        """q or k projected, normalized first where the norm is over the whole projection
        (OLMo 2), split into heads."""
        y = getattr(self, f"{which}_proj")(x)
        if self.qk_norm == "whole":
            y = getattr(self, f"{which}_norm")(y)
        return split_heads(y, n, self.head_dim, step)

    def _gated(self, out, x):
        """out (1, T, H*D), each head or element times sigmoid(g_proj(x)) where the model
        gates."""
        if not self.gate:
            return out
        if self.gate == "element":
            return out * torch.sigmoid(self.g_proj(x))
        gate = torch.sigmoid(self.g_proj(x)).unsqueeze(-1)  # (1, T, H, 1)
        heads = out.view(1, -1, self.n_heads, self.head_dim) * gate
        return heads.view(1, -1, self.n_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.act = ACTIVATIONS[activation(cfg)]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention then feed-forward, each a residual branch with the norms NORMS places (the ones
    before a linear fold into it with fold_norms); Granite scales each branch by
    residual_multiplier."""

    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant, window: int | None,
                 rope: str | None):
        super().__init__()
        self.self_attn = Attention(cfg, opts, dtype, variant, window, rope)
        self.mlp = MLP(cfg)
        self.norms = NORMS[variant.norms]
        self.residual = getattr(cfg, "residual_multiplier", 1.0)
        for slot, name in self.norms.items():
            affine = not (opts.fold_norms and slot.endswith("_pre"))
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm, affine))

    def _norm(self, slot: str, x):
        return getattr(self, self.norms[slot])(x) if slot in self.norms else x

    def _add(self, x, h):
        return x + h if self.residual == 1.0 else x + h * self.residual

    def forward(self, x, step, last_only: bool = False):
        x = self._add(x, self._norm("attn_post", self.self_attn(self._norm("attn_pre", x), step)))
        x = x[:, -1] if last_only else x  # run_decoder: (1, hidden), the last token
        return self._add(x, self._norm("ffn_post", self.mlp(self._norm("ffn_pre", x))))


class Backbone(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant, ropes: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = getattr(cfg, "layer_types", None) or [FULL] * cfg.num_hidden_layers
        nope = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 0 where a layer has no RoPE
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, opts, dtype, variant, window,
                         None if nope is not None and not nope[i] else
                         kinds[i] if kinds[i] in ropes else FULL)
            for i, window in enumerate(layer_windows(cfg)))
        if variant.ffn:
            for i, layer in enumerate(self.layers):
                layer.mlp = variant.ffn(cfg, i) or layer.mlp
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm)


class LlamaForCausalLM(nn.Module):
    """Llama and every relative (Variant); `family` names it in errors."""

    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant = Variant(),
                 family: str = "Llama"):
        super().__init__()
        self.opts, self.variant, self.family = opts, variant, family
        ropes = hf_ropes(cfg, variant.rotary, opts)
        self.model = Backbone(cfg, opts, dtype, variant, ropes)
        if len(ropes) == 1:
            self.rope = ropes[FULL]
        else:
            self.ropes = nn.ModuleDict(ropes)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.embed_scale = (cfg.hidden_size ** 0.5 if variant.embed_sqrt
                            else getattr(cfg, "embedding_multiplier", None))
        self.logit_divisor = getattr(cfg, "logits_scaling", 1.0)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        if self.logit_divisor != 1.0 or self.softcap:
            self.finish_logits = self._finish_logits
        self.state_dict_hooks = (self._drop_tied_head,)
        if variant.fused:
            self.state_dict_hooks += (self._split_fused,)
        if variant.norm_offset:
            self.state_dict_hooks += (self._offset_norms,)
        if opts.fold_norms:
            self.state_dict_hooks += (self._fold_norms,)
        if self.model.layers[0].self_attn.fused:  # after the fold, which writes q/k_proj
            self.state_dict_hooks += (self._fuse_qk,)

    def _finish_logits(self, logits):
        if self.logit_divisor != 1.0:  # Granite
            logits = logits / self.logit_divisor
        if self.softcap:  # Gemma
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def source_name(self, name: str) -> str:
        """The checkpoint's name of a parameter split at load time (Phi-3's fused projections),
        so that a GGUF's storage type of the fused tensor reaches each part."""
        if self.variant.fused:
            for part in "qkv":
                name = name.replace(f".self_attn.{part}_proj.", ".self_attn.qkv_proj.")
            for part in ("gate", "up"):
                name = name.replace(f".mlp.{part}_proj.", ".mlp.gate_up_proj.")
        return name

    def _split_fused(self, sd: dict) -> None:
        """Phi-3's qkv_proj (rows q, k, v) and gate_up_proj (rows gate, up) -> the parts. A split
        by rows keeps whole the blocks a GGUF quantizes along each row."""
        attn = self.model.layers[0].self_attn
        qkv = (attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim,
               attn.n_kv * attn.head_dim)
        for key in [k for k in sd if k.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
            prefix, tensor = key.rsplit(".", 2)[0], sd.pop(key)
            attention = key.endswith(".qkv_proj.weight")
            sizes = qkv if attention else (tensor.shape[0] // 2,) * 2
            if tensor.shape[0] != sum(sizes):
                raise InputError(f"Checkpoint tensor {key} has shape {tuple(tensor.shape)}; "
                                 f"expected {sum(sizes)} rows. Check that the weights and "
                                 "config.json come from the same model.")
            names = ("q_proj", "k_proj", "v_proj") if attention else ("gate_proj", "up_proj")
            for i, name in enumerate(names):
                sd[f"{prefix}.{name}.weight"] = derive(lambda t, i, rows: t.split(rows)[i],
                                                       tensor, i, list(sizes))

    @staticmethod
    def _offset_norms(sd: dict) -> None:
        """Gemma stores each norm weight as w - 1 and multiplies by (1 + w)."""
        for key in [k for k in sd if k.endswith("norm.weight")]:
            sd[key] = sd[key].float() + 1.0

    def _fold_norms(self, sd: dict) -> None:
        """Each block's norms before a linear fold into it (those after a branch cannot)."""
        for i, layer in enumerate(self.model.layers):
            p, norms = f"model.layers.{i}", layer.norms
            if "attn_pre" in norms:
                fold_norm(sd, f"{p}.{norms['attn_pre']}",
                          [f"{p}.self_attn.{n}_proj" for n in "qkvg"
                           if n != "g" or hasattr(layer.self_attn, "g_proj")])
            if "ffn_pre" in norms and isinstance(layer.mlp, SparseMoE):
                fold_into_experts(sd, f"{p}.{norms['ffn_pre']}", f"{p}.mlp")
            elif "ffn_pre" in norms:
                fold_norm(sd, f"{p}.{norms['ffn_pre']}",
                          [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])

    def _fuse_qk(self, sd: dict) -> None:
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            fuse_qk_weights(sd, f"model.layers.{i}.self_attn", ("q_norm", "k_norm"), attn.n_heads,
                            attn.n_kv)

    def _drop_tied_head(self, sd: dict) -> None:
        # Tied checkpoints may or may not store lm_head.weight; it is embed_tokens.weight anyway
        if self.tied:
            sd.pop("lm_head.weight", None)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return run_decoder(self, tokens, input_pos, self.model.norm, head_weight(self))


def build(cfg, opts: ModelOptions, dtype, variant: Variant = Variant(),
          family: str = "Llama") -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, opts, dtype, variant, family)


# --- ExecuTorch's export_llm: Meta names, params JSON, model classes ---------------------------

META_NAMES = {**{f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
              "attention.wo.weight": "self_attn.o_proj.weight",
              "attention_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight",
              "feed_forward.w1.weight": "mlp.gate_proj.weight",
              "feed_forward.w2.weight": "mlp.down_proj.weight",
              "feed_forward.w3.weight": "mlp.up_proj.weight"}
UNSCALED_ROPE = "use_scaled_rope=true: ExecuTorch scales RoPE only for Meta-layout Llamas"


def attention_only(p: dict) -> list[str]:
    """Every layer an attention layer, where the params name layer kinds."""
    return layer_kinds(p, ("full_attention",)) if p["layer_types"] is not None else []


def default_rope(p: dict) -> dict:
    return {"rope_type": "default", "rope_theta": float(p["rope_freq_base"])}


def _params_problems(p: dict, model_class: str) -> list[str]:
    out = attention_only(p)
    if p["use_qk_norm"]:
        out.append("use_qk_norm=true: Llama has no q/k norms (Qwen3 has: model_class "
                   "qwen3_0_6b, qwen3_1_7b or qwen3_4b)")
    if p["use_scaled_rope"] and not p["use_hf_rope"] and model_class in ("llama2", "stories110m"):
        out.append(f"use_scaled_rope=true is refused by ExecuTorch for {model_class}")
    return out


def _rope(p: dict, model_class: str) -> dict:
    # ExecuTorch scales RoPE only on its own (use_hf_rope false) path, as Llama 3 does at original
    # length 8192 with low_freq_factor 1 (rope.py apply_scaling); model.py forces the factor to
    # 32 for classes other than llama3 and llama3_1.
    if not p["use_scaled_rope"] or p["use_hf_rope"]:
        return default_rope(p)
    factor = p["rope_scale_factor"] if model_class in ("llama3", "llama3_1") else 32
    return {"rope_type": "llama3", "rope_theta": float(p["rope_freq_base"]),
            "factor": float(factor), "low_freq_factor": 1.0,
            "high_freq_factor": float(p["high_freq_factor"]),
            "original_max_position_embeddings": 8192}


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import LlamaConfig

    rope = _rope(p, model_class)
    if rope["rope_type"] == "llama3":  # transformers wants it above the original 8192
        common = {**common, "max_position_embeddings": 131072}
    return LlamaConfig(**common, rms_norm_eps=p["norm_eps"], head_dim=p["head_dim"],
                       rope_parameters=rope, tie_word_embeddings=tied, attention_bias=False,
                       mlp_bias=False)


def relative(model_type: str, summary: str, variant: Variant, family: str, *,
             executorch: ExecuTorchLayout | None = None, gguf: GgufLayout | None = None,
             unsupported=unsupported) -> Architecture:
    """The Architecture of a Llama-layout relative: these classes with `variant`, named `family`
    in errors, and, where ExecuTorch's export_llm or llama.cpp has it, its layout there."""
    return Architecture(
        model_type=model_type, summary=summary,
        build=lambda cfg, opts, dtype: build(cfg, opts, dtype, variant, family),
        unsupported=unsupported, executorch=executorch, gguf=gguf)


def meta_layout(model_classes: tuple[str, ...], meta_names: dict, problems, config,
                qkv_bias: bool = False, reads: tuple[str, ...] = ()) -> ExecuTorchLayout:
    """How export_llm holds a Llama-layout relative: Meta's Llama names plus `meta_names`."""
    return ExecuTorchLayout(model_classes=model_classes, layer_names={**META_NAMES, **meta_names},
                            final_norm="model.norm.weight", problems=problems, config=config,
                            qkv_bias=qkv_bias, reads=reads)


ARCHITECTURE = relative(
    "llama", "Llama 3.x, SmolLM2 and other Llama-layout models", Variant(), "Llama",
    executorch=meta_layout(("stories110m", "llama2", "llama3", "llama3_1", "llama3_2", "smollm2"),
                           {}, _params_problems, _config),
    gguf=GgufLayout("llama", permuted=True))  # Mistral's files are llama ones
