"""LFM2 and LFM2.5 (transformers `model_type: lfm2`): short-conv blocks and attention blocks.

Same math and parameter names as transformers' Lfm2ForCausalLM. Differences:
- The short conv keeps its state as a (1, hidden, L_cache-1) mutable buffer: each call convolves
  [state, B*x] without padding and keeps the last L_cache-1 columns, so prefill and decode are one
  code path. The state is zeroed when a call starts a sequence (input_pos == 0).
- `in_proj` is split at load time into B, C and x projections (one place: `_split_in_proj`):
  a split of the fused output breaks XNNPACK graphs (split_with_sizes has no XNNPACK config).
  `source_name` maps the three back, so a GGUF's storage type of in_proj reaches each of them.
- A static KV cache per attention layer; only the last token's logits are computed.

ExecuTorch's export_llm holds LFM2 in Meta's names (examples/models/lfm2/convert_weights.py: the
in_proj as three `B_proj`, `C_proj`, `x_proj` chunks, joined back here) with params that must
ask for half-split RoPE and q/k norms before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .cache import KVCache
from .layers import (CausalConv, ModelOptions, RMSNorm, Rope, fold_norm,
                     fuse_qk_weights, fused_qk, head_weight, run_decoder, split_heads,
                     time_major_conv)
from .moe import SparseMoE, fold_into_experts
from .pending import Pending, derive
from .registry import Architecture, ExecuTorchLayout, GgufLayout, layer_kinds

KINDS = ("conv", "full_attention")


def kind_problems(cfg, known: tuple[str, ...]) -> list[str]:
    """layer_types against the layer count and the kinds an LFM generation knows."""
    out = []
    kinds = list(cfg.layer_types or [])
    if len(kinds) != cfg.num_hidden_layers:
        out.append(f"layer_types has {len(kinds)} entries but num_hidden_layers is "
                   f"{cfg.num_hidden_layers}")
    odd = sorted({k for k in kinds if k not in known})
    if odd:
        out.append(f"layer_types holds {odd}; known kinds are "
                   f"{', '.join(repr(k) for k in known)}")
    return out


def check(cfg) -> list[str]:
    return kind_problems(cfg, KINDS)  # sizes and head counts: registry.config_problems


def ffn_width(cfg) -> int:
    width = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", False):  # LFM3 has no such field
        width = int(2 * width / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            width = int(cfg.block_ffn_dim_multiplier * width)
            m = cfg.block_multiple_of
            width = m * ((width + m - 1) // m)
    return width


class Attention(nn.Module):
    """With `fuse_qk`, q and k are computed as one (layers.fused_qk)."""

    def __init__(self, cfg, opts: ModelOptions, dtype):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // self.n_heads
        hd, self.fused = self.head_dim, opts.fuse_qk
        if self.fused:
            self.qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + self.n_kv) * hd, bias=False)
            self.qk_layernorm = RMSNorm(hd, cfg.norm_eps, opts.norm, affine=False)
            self.qk_weight = nn.Parameter(torch.empty(self.n_heads + self.n_kv, 1, hd))
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=False)
            self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=False)
            self.q_layernorm = RMSNorm(hd, cfg.norm_eps, opts.norm)
            self.k_layernorm = RMSNorm(hd, cfg.norm_eps, opts.norm)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=False)
        self.out_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)
        with torch.device("cpu"):
            self.cache = KVCache(self.n_heads, self.n_kv, hd, opts, dtype)

    def forward(self, x, step):
        v = split_heads(self.v_proj(x), self.n_kv, self.head_dim, step)
        if self.fused:
            q, k = fused_qk(self, x, step, step.rope)
        else:
            q = self.q_layernorm(split_heads(self.q_proj(x), self.n_heads, self.head_dim, step))
            k = self.k_layernorm(split_heads(self.k_proj(x), self.n_kv, self.head_dim, step))
            q, k = step.rope(q), step.rope(k)
        return self.out_proj(self.cache(q, k, v, step))


class ShortConv(CausalConv):
    """B*x through the causal conv (layers.CausalConv), gated by C."""

    def __init__(self, cfg, opts: ModelOptions, dtype):
        super().__init__()
        d, L, bias = cfg.hidden_size, cfg.conv_L_cache, cfg.conv_bias
        self.init_state(d, L, opts, dtype)
        self.b_proj = nn.Linear(d, d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.x_proj = nn.Linear(d, d, bias=bias)
        self.conv = self.conv_module(d, L, bias)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x, step):
        bx = self.b_proj(x) * self.x_proj(x)  # (1, T, D)
        y = self.causal_conv(self.conv, bx, step)
        return self.out_proj(self.c_proj(x) * y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        width = ffn_width(cfg)
        self.w1 = nn.Linear(cfg.hidden_size, width, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, width, bias=False)
        self.w2 = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    """A conv or attention block, then the feed-forward. `attention` makes the attention (LFM3's,
    llama.Attention with a gate); `sandwich` adds LFM3's norms after each branch; `feed_forward`
    replaces the MLP (LFM2-MoE's experts)."""

    def __init__(self, cfg, kind: str, opts: ModelOptions, dtype, attention=None,
                 sandwich: bool = False, feed_forward: nn.Module | None = None):
        super().__init__()
        self.is_attention = kind != "conv"
        if self.is_attention:
            self.self_attn = attention() if attention else Attention(cfg, opts, dtype)
        else:
            self.conv = ShortConv(cfg, opts, dtype)
        self.feed_forward = feed_forward or MLP(cfg)  # LFM2-MoE's sparse blocks: lfm2_moe.py
        affine = not opts.fold_norms
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, opts.norm, affine)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, opts.norm, affine)
        self.sandwich = sandwich
        if sandwich:
            self.post_operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, opts.norm)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, opts.norm)

    def forward(self, x, step, last_only: bool = False):
        h = self.operator_norm(x)
        h = self.self_attn(h, step) if self.is_attention else self.conv(h, step)
        x = x + (self.post_operator_norm(h) if self.sandwich else h)
        x = x[:, -1] if last_only else x  # run_decoder: (1, hidden), the last token
        h = self.feed_forward(self.ffn_norm(x))
        return x + (self.post_ffn_norm(h) if self.sandwich else h)


class Backbone(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype, layer=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer = layer or (lambda i, kind: DecoderLayer(cfg, kind, opts, dtype))
        self.layers = nn.ModuleList(layer(i, kind) for i, kind in enumerate(cfg.layer_types))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, opts.norm)


class Lfm2ForCausalLM(nn.Module):
    """LFM2; LFM3 (lfm3.py) gives its own layers (`layer`: (index, kind) -> DecoderLayer), its
    rotary tables (`ropes`) and the names of its q and k norms."""

    family = "LFM2"
    qk_norms = ("q_layernorm", "k_layernorm")

    def __init__(self, cfg, opts: ModelOptions, dtype, layer=None, ropes: dict | None = None):
        super().__init__()
        from transformers.models.lfm2.modeling_lfm2 import Lfm2RotaryEmbedding

        self.opts, self.hidden = opts, cfg.hidden_size
        self.model = Backbone(cfg, opts, dtype, layer)
        if ropes:
            self.ropes = nn.ModuleDict(ropes)
        else:
            with torch.device("cpu"):
                hf_rope = Lfm2RotaryEmbedding(cfg)
                self.rope = Rope(hf_rope.inv_freq, hf_rope.attention_scaling,
                                 opts.max_context_len, opts.rope)
        self.state_dict_hooks = (self._split_in_proj, self._drop_tied_head)
        if opts.conv == "window":
            self.state_dict_hooks += (self._time_major_conv,)
        if opts.fold_norms:
            self.state_dict_hooks += (self._fold_norms,)
        if opts.fuse_qk:
            self.state_dict_hooks += (self._fuse_qk,)

    @staticmethod
    def source_name(name: str) -> str:
        """The checkpoint's name of a parameter: b/c/x_proj are rows of `conv.in_proj`. A split
        by rows keeps whole the blocks a GGUF quantizes along each row, so the file's grid (and
        storage type) holds for each part."""
        for part in ("b_proj", "c_proj", "x_proj"):
            name = name.replace(f".conv.{part}.", ".conv.in_proj.")
        return name

    def _split_in_proj(self, sd: dict) -> None:
        """HF's fused conv.in_proj (3*hidden rows: B, C, x) -> b_proj, c_proj, x_proj."""
        for key in [k for k in sd if k.endswith(".conv.in_proj.weight")
                    or k.endswith(".conv.in_proj.bias")]:
            prefix, leaf = key.rsplit(".in_proj.", 1)
            tensor = sd.pop(key)
            if tensor.shape[0] != 3 * self.hidden:
                raise_shape(key, tensor, 3 * self.hidden)
            for i, name in enumerate(("b_proj", "c_proj", "x_proj")):
                sd[f"{prefix}.{name}.{leaf}"] = derive(lambda t, i: t.chunk(3, dim=0)[i], tensor, i)

    @staticmethod
    def _time_major_conv(sd: dict) -> None:
        time_major_conv(sd, ".conv.conv.weight")

    def _fold_norms(self, sd: dict) -> None:
        """Each block's two norms feed only linears: fold their weights into them."""
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            mixer = ([f"{p}.self_attn.{n}_proj" for n in "qkvg"
                      if n != "g" or hasattr(layer.self_attn, "g_proj")] if layer.is_attention
                     else [f"{p}.conv.{n}_proj" for n in ("b", "c", "x")])
            fold_norm(sd, f"{p}.operator_norm", mixer)
            if isinstance(layer.feed_forward, SparseMoE):
                fold_into_experts(sd, f"{p}.ffn_norm", f"{p}.feed_forward")
            else:
                fold_norm(sd, f"{p}.ffn_norm", [f"{p}.feed_forward.w1", f"{p}.feed_forward.w3"])

    def _fuse_qk(self, sd: dict) -> None:
        for i, layer in enumerate(self.model.layers):
            if layer.is_attention:
                attn = layer.self_attn
                fuse_qk_weights(sd, f"model.layers.{i}.self_attn", self.qk_norms, attn.n_heads,
                                attn.n_kv)

    def _drop_tied_head(self, sd: dict) -> None:
        """LFM2 ties the head to embed_tokens; a checkpoint may still store a copy of it."""
        head, embed = sd.pop("lm_head.weight", None), sd.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(
                *(t.read() if isinstance(t, Pending) else t for t in (head, embed))):
            raise InputError(f"Checkpoint tensor lm_head.weight differs from "
                             f"model.embed_tokens.weight, but {self.family} ties its head to "
                             f"the embedding. Check that the weights come from an {self.family} "
                             "model.")

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        # LFM2's "embedding_norm" is its final norm; the head is tied to the embedding
        return run_decoder(self, tokens, input_pos, self.model.embedding_norm, head_weight(self))


def raise_shape(key, tensor, rows):
    raise InputError(f"Checkpoint tensor {key} has shape {tuple(tensor.shape)}; expected "
                     f"{rows} rows (B, C and x for hidden_size {rows // 3}). Check that the "
                     "weights and config.json come from the same model.")


def build(cfg, opts: ModelOptions, dtype) -> Lfm2ForCausalLM:
    with torch.device("meta"):
        return Lfm2ForCausalLM(cfg, opts, dtype)


# --- ExecuTorch's export_llm: Meta names, params JSON, model classes ---------------------------

_CONV_PARTS = ("conv.B_proj.weight", "conv.C_proj.weight", "conv.x_proj.weight")


def _join_in_proj(sd: dict) -> dict:
    """lfm_2_to_meta splits conv.in_proj into B, C and x (torch.chunk); join each layer's three
    back. A layer with some missing keeps them apart, for the loader to name."""
    out, parts = {}, {}
    for key, value in sd.items():
        layer, _, rest = key.partition(".conv.")
        if rest and f"conv.{rest}" in _CONV_PARTS and layer.startswith("layers."):
            parts.setdefault(layer, {})[f"conv.{rest}"] = (key, value)
        else:
            out[key] = value
    for layer, found in parts.items():
        if len(found) == len(_CONV_PARTS):
            out[f"{layer}.conv.in_proj.weight"] = torch.cat([found[k][1] for k in _CONV_PARTS])
        else:
            out.update(found.values())
    return out


def _params_problems(p: dict, model_class: str) -> list[str]:
    out = layer_kinds(p, KINDS)
    if not (p["use_hf_rope"] and p["use_qk_norm"] and p["qk_norm_before_rope"]):
        out.append("use_hf_rope, use_qk_norm and qk_norm_before_rope must all be true, as in "
                   "ExecuTorch's lfm2 configs (LFM2 normalises q and k before half-split RoPE)")
    if p["head_dim"] * p["n_heads"] != p["dim"]:
        out.append(f"head_dim {p['head_dim']} must be dim / n_heads = {p['dim'] / p['n_heads']}")
    return out


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import Lfm2Config

    return Lfm2Config(**common, norm_eps=p["norm_eps"], tie_word_embeddings=True,
                      layer_types=list(p["layer_types"][:p["n_layers"]]),
                      rope_parameters={"rope_type": "default",
                                       "rope_theta": float(p["rope_freq_base"])},
                      conv_L_cache=3, conv_bias=False,  # ShortConv's fixed kernel, no bias
                      block_auto_adjust_ff_dim=False)  # hidden_dim is already the width


_QKV = {f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"}

EXECUTORCH = ExecuTorchLayout(
    model_classes=("lfm2_350m", "lfm2_700m", "lfm2_1_2b", "lfm2_5_350m", "lfm2_5_1_2b"),
    layer_names={**_QKV, "attention.wo.weight": "self_attn.out_proj.weight",
                 "attention.q_norm_fn.weight": "self_attn.q_layernorm.weight",
                 "attention.k_norm_fn.weight": "self_attn.k_layernorm.weight",
                 "attention_norm.weight": "operator_norm.weight",
                 **{k: k for k in ("ffn_norm.weight", "conv.in_proj.weight", "conv.conv.weight",
                                   "conv.out_proj.weight", "feed_forward.w1.weight",
                                   "feed_forward.w2.weight", "feed_forward.w3.weight")}},
    final_norm="model.embedding_norm.weight",
    problems=_params_problems, config=_config, join=_join_in_proj,
    always_tied="LFM2 ties its output head to the embedding")

ARCHITECTURE = Architecture(
    model_type="lfm2", summary="LFM2 and LFM2.5 (short-conv + attention hybrids)",
    build=build, check=check, executorch=EXECUTORCH, gguf=GgufLayout("lfm2"))
