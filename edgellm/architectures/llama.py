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

import torch
import torch.nn.functional as F
from torch import nn

from .layers import (KVCache, ModelOptions, RMSNorm, Rope, fold_norm, fuse_qk_weights, fused_qk,
                     head_weight, run_decoder, split_heads)
from .registry import Architecture, ExecuTorchLayout, layer_kinds


def check(cfg) -> list[str]:
    out = []
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        out.append(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                   f"num_key_value_heads {cfg.num_key_value_heads}")
    return out


def sliding_layers(cfg, family: str) -> list[str]:
    """Qwen's sliding-window layers (from max_window_layers on, when use_sliding_window is set):
    the static cache here keeps every position, so such models are refused by name."""
    sliding = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or [])
               if kind != "full_attention"]
    if getattr(cfg, "use_sliding_window", False) and sliding:
        return [f"sliding-window attention in layers {sliding} (use_sliding_window); only "
                f"full-attention {family} models export"]
    return []


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_for(cfg, opts: ModelOptions) -> Rope:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        hf_rope = LlamaRotaryEmbedding(cfg)
        return Rope(hf_rope.inv_freq, hf_rope.attention_scaling, opts.max_context_len, opts.rope)


@dataclass(frozen=True)
class Variant:
    """What Llama-layout relatives add: Qwen2 biases on q, k and v (not o); Qwen3 an RMSNorm over
    each head of q and k, before RoPE."""

    qkv_bias: bool = False
    qk_norm: bool = False


class Attention(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, head_dim(cfg))
        bias = getattr(cfg, "attention_bias", False)
        qkv_bias, hd, eps = bias or variant.qkv_bias, self.head_dim, cfg.rms_norm_eps
        self.qk_norm = variant.qk_norm
        self.fused = self.qk_norm and opts.fuse_qk and not qkv_bias  # layers.fused_qk
        if self.fused:
            self.qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + self.n_kv) * hd, bias=False)
            self.qk_layernorm = RMSNorm(hd, eps, opts.norm, affine=False)
            self.qk_weight = nn.Parameter(torch.empty(self.n_heads + self.n_kv, 1, hd))
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=qkv_bias)
            self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        if self.qk_norm and not self.fused:
            self.q_norm = RMSNorm(hd, eps, opts.norm)
            self.k_norm = RMSNorm(hd, eps, opts.norm)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=bias)
        with torch.device("cpu"):
            self.cache = KVCache(self.n_heads, self.n_kv, self.head_dim, opts, dtype)

    def forward(self, x, step):
        if self.fused:
            v = split_heads(self.v_proj(x), self.n_kv, self.head_dim, step)
            q, k = fused_qk(self, x, step)
            return self.o_proj(self.cache(q, k, v, step))
        q = split_heads(self.q_proj(x), self.n_heads, self.head_dim, step)
        k = split_heads(self.k_proj(x), self.n_kv, self.head_dim, step)
        v = split_heads(self.v_proj(x), self.n_kv, self.head_dim, step)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = step.rope(q), step.rope(k)
        return self.o_proj(self.cache(q, k, v, step))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant):
        super().__init__()
        self.self_attn = Attention(cfg, opts, dtype, variant)
        self.mlp = MLP(cfg)
        affine = not opts.fold_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm, affine)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm,
                                                affine)

    def forward(self, x, step, last_only: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), step)
        x = x[:, -1] if last_only else x  # run_decoder: (1, hidden), the last token
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, opts, dtype, variant)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, variant: Variant = Variant()):
        super().__init__()
        self.opts = opts
        self.model = Backbone(cfg, opts, dtype, variant)
        self.rope = rope_for(cfg, opts)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.state_dict_hooks = (self._drop_tied_head,)
        if opts.fold_norms:
            self.state_dict_hooks += (self._fold_norms,)
        if self.model.layers[0].self_attn.fused:  # after the fold, which writes q/k_proj
            self.state_dict_hooks += (self._fuse_qk,)

    def _fold_norms(self, sd: dict) -> None:
        """Each block's two norms feed only linears: fold their weights into them."""
        for i in range(len(self.model.layers)):
            p = f"model.layers.{i}"
            fold_norm(sd, f"{p}.input_layernorm", [f"{p}.self_attn.{n}_proj" for n in "qkv"])
            fold_norm(sd, f"{p}.post_attention_layernorm",
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


def build(cfg, opts: ModelOptions, dtype, variant: Variant = Variant()) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, opts, dtype, variant)


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
             model_classes: tuple[str, ...], meta_names: dict, problems, config,
             qkv_bias: bool = False) -> Architecture:
    """The Architecture of a Llama-layout relative: these classes with `variant`, sliding-window
    layers refused by `family`'s name, and its ExecuTorch layout (Meta's Llama names plus
    `meta_names`)."""
    return Architecture(
        model_type=model_type, summary=summary, check=check,
        build=lambda cfg, opts, dtype: build(cfg, opts, dtype, variant),
        unsupported=lambda cfg: sliding_layers(cfg, family),
        executorch=ExecuTorchLayout(
            model_classes=model_classes, layer_names={**META_NAMES, **meta_names},
            final_norm="model.norm.weight", problems=problems, config=config,
            qkv_bias=qkv_bias))


ARCHITECTURE = Architecture(
    model_type="llama", summary="Llama 3.x, SmolLM2 and other Llama-layout models",
    build=build, check=check, executorch=ExecuTorchLayout(
        model_classes=("stories110m", "llama2", "llama3", "llama3_1", "llama3_2", "smollm2"),
        layer_names=META_NAMES, final_norm="model.norm.weight", problems=_params_problems,
        config=_config))
