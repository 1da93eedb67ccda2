"""Qwen3.5 (transformers `model_type: qwen3_5_text`, and the text decoder of a `qwen3_5` folder):
gated DeltaNet layers (`linear_attention`) interleaved with gated full-attention layers, 3 : 1.

Same math and parameter names as transformers' Qwen3_5ForCausalLM. A DeltaNet layer projects the
block's input to q, k and v through a depthwise causal conv (kernel 4) and SiLU, L2-normalizes
each q and k head, and runs the gated delta rule over a state matrix (key dim x value dim) per
value head, with a decay exp(-exp(A_log) * softplus(a + dt_bias)) and a write strength
sigmoid(b) per token and head; its output is RMS-normalized per head and gated by SiLU(z). What it
keeps between calls is two buffers: the conv state (layers.CausalConv, as LFM2's) and the
recurrent state (1, value heads, key dim, value dim), float32 whatever the model's dtype or
recipe (ExecuTorch's kernel takes float32 only). Both are zeroed when a call starts a sequence.

The recurrence over a call's T tokens (ModelOptions.delta_rule): "op" is ExecuTorch's
`llama::gated_delta_rule`, which runs it over any T (XNNPACK and portable programs, whose T is
dynamic: a prompt of any length in one call); "loop" is the same recurrence token by token in
matmuls, for programs whose T is fixed (Core ML, Vulkan: one step a decode call, N a prefill
chunk of N).

A full-attention layer is Qwen3's (llama.Attention: per-head q and k norms before RoPE) with
partial rotary (a quarter of each head) and a sigmoid gate per output element: q_proj's rows hold
each head's query then its gate, split at load time into q_proj and g_proj. Every RMSNorm weight
but the DeltaNet's gated norm is stored as w - 1 and applied as 1 + w.

ExecuTorch's export_llm holds Qwen3.5 in Meta's names (examples/models/qwen3_5/convert_weights.py)
with the same tensors, and params that must ask for the q gate and the unit offset.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from . import lfm2, llama
from .layers import (FULL, CausalConv, ModelOptions, RMSNorm, fold_norm, fuse_qk_weights,
                     head_weight, run_decoder, time_major_conv, write_at)
from .registry import Architecture, layer_kinds, text_tensors

KINDS = ("linear_attention", "full_attention")
VARIANT = llama.Variant(qk_norm="head", gate="element",
                        rotary="qwen3_5.modeling_qwen3_5:Qwen3_5TextRotaryEmbedding")
L2_EPS = 1e-6  # transformers' l2norm of q and k (as the FLA kernels)
# norms stored as w - 1 (Qwen3_5RMSNorm); the DeltaNet's gated norm is not one of them
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                ".self_attn.q_norm.weight", ".self_attn.k_norm.weight")
LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
          "linear_num_key_heads", "linear_num_value_heads")


def check(cfg) -> list[str]:
    out = lfm2.kind_problems(cfg, KINDS)
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        out.append(f"linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
                   f"linear_num_key_heads {cfg.linear_num_key_heads}")
    return out


def unsupported(cfg) -> list[str]:
    return llama.unsupported(cfg) + (["attention_bias"] if cfg.attention_bias else [])


def softplus(x):
    """log(1 + e^x) as relu(x) + log(1 + e^-|x|), in ops XNNPACK has (F.softplus decomposes
    into log1p and a select, which it has not); equal to it in float32 (below x = -17, where
    this gives 0 and log1p e^x, which is under 4e-8, the decay it sets is 1 either way)."""
    return F.relu(x) + torch.log(1 + torch.exp(-x.abs()))


class GatedDeltaNet(CausalConv):
    """A linear-attention layer: the conv state (CausalConv), then the gated delta rule over the
    call's tokens from the recurrent state, as `delta_rule` says."""

    def __init__(self, cfg, opts: ModelOptions, dtype):
        super().__init__()
        d = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key, self.value = self.hk * self.dk, self.hv * self.dv
        channels, L = 2 * self.key + self.value, cfg.linear_conv_kernel_dim
        self.init_state(channels, L, opts, dtype)
        self.rule, self.act = opts.delta_rule, llama.ACTIVATIONS[llama.activation(cfg)]
        if self.rule == "op":
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama::
        self.in_proj_qkv = nn.Linear(d, channels, bias=False)
        self.in_proj_z = nn.Linear(d, self.value, bias=False)
        self.in_proj_b = nn.Linear(d, self.hv, bias=False)
        self.in_proj_a = nn.Linear(d, self.hv, bias=False)
        self.conv1d = self.conv_module(channels, L, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps, opts.norm)
        self.out_proj = nn.Linear(self.value, d, bias=False)
        with torch.device("cpu"):
            self.register_buffer("recurrent_state", torch.zeros(1, self.hv, self.dk, self.dv),
                                 persistent=False)
            if self.state_write == "index_put":  # Vulkan: the write as one index_put_
                self.register_buffer("state_heads", torch.arange(self.hv), persistent=False)
            if opts.norm == "linear_mean":  # XNNPACK has no sum: q and k's norms as a linear
                self.register_buffer("ones_row", torch.ones(1, self.dk), persistent=False)

    def forward(self, x, step):
        mixed = self.act(self.causal_conv(self.conv1d, self.in_proj_qkv(x), step))  # (1, T, C)
        q = self._heads(mixed.narrow(-1, 0, self.key)) * self.dk ** -0.5
        k = self._heads(mixed.narrow(-1, self.key, self.key))
        v = mixed.narrow(-1, 2 * self.key, self.value).view(1, -1, self.hv, self.dv).float()
        beta = torch.sigmoid(self.in_proj_b(x).float())  # (1, T, Hv)
        decay = torch.exp(-torch.exp(self.A_log.float())
                          * softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        # eagerly the kernel would log a line per call ("No temp allocator provided"); the loop
        # computes the same there, and traced programs get the kernel
        traced = torch.compiler.is_compiling()
        rule = self._op if self.rule == "op" and traced else self._loop
        out, state = rule(q, k, v, decay, beta, self.recurrent_state * step.keep)
        if self.state_write == "index_put":
            write_at(self.recurrent_state, 1, self.state_heads, state)
        else:
            self.recurrent_state.copy_(state)
        z = self.in_proj_z(x).view(1, -1, self.hv, self.dv)
        y = self.norm(out.to(x.dtype)) * F.silu(z)  # (1, T, Hv, Dv)
        return self.out_proj(y.reshape(1, -1, self.value))

    def _heads(self, x):
        """q or k (1, T, Hk*Dk) -> L2-normalized heads in float32, each key head repeated for
        the value heads it serves: (1, T, Hv, Dk)."""
        x = x.view(1, -1, self.hk, self.dk).float()
        squares = x * x
        sums = (F.linear(squares, self.ones_row) if hasattr(self, "ones_row")
                else squares.sum(-1, keepdim=True))
        x = x * torch.rsqrt(sums + L2_EPS)
        if self.hv == self.hk:
            return x
        r = self.hv // self.hk
        return x[:, :, :, None, :].expand(-1, -1, -1, r, -1).reshape(1, -1, self.hv, self.dk)

    @staticmethod
    def _op(q, k, v, decay, beta, state):
        """ExecuTorch's kernel over every token of the call, heads first (1, H, T, D)."""
        heads = [t.transpose(1, 2).contiguous() for t in (q, k, v, decay, beta)]
        out, state = torch.ops.llama.gated_delta_rule(*heads, state)
        return out.transpose(1, 2), state

    @staticmethod
    def _loop(q, k, v, decay, beta, state):
        """The same recurrence a token at a time: decay the state, write v's error against
        what the state recalls for k, read it with q."""
        outs = []
        for t in range(q.shape[1]):
            q_t, k_t, v_t = (x[:, t].unsqueeze(-2) for x in (q, k, v))  # (1, H, 1, D)
            state = state * decay[:, t, :, None, None]
            delta = (v_t - k_t @ state) * beta[:, t, :, None, None]
            state = state + k_t.transpose(-1, -2) @ delta
            outs.append(q_t @ state)
        return torch.cat(outs, 2).transpose(1, 2), state


class DecoderLayer(nn.Module):
    def __init__(self, cfg, kind: str, opts: ModelOptions, dtype):
        super().__init__()
        self.is_attention = kind == FULL
        if self.is_attention:
            self.self_attn = llama.Attention(cfg, opts, dtype, VARIANT, None, FULL)
        else:
            self.linear_attn = GatedDeltaNet(cfg, opts, dtype)
        self.mlp = llama.MLP(cfg)
        affine = not opts.fold_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm, affine)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm,
                                                affine)

    def forward(self, x, step, last_only: bool = False):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, step) if self.is_attention else self.linear_attn(h, step))
        x = x[:, -1] if last_only else x  # run_decoder: (1, hidden), the last token
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg, opts: ModelOptions, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, opts, dtype)
                                    for kind in cfg.layer_types[:cfg.num_hidden_layers])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.norm)


class Qwen3_5ForCausalLM(nn.Module):
    family = "Qwen3.5"

    def __init__(self, cfg, opts: ModelOptions, dtype):
        super().__init__()
        self.opts = opts
        self.rope = llama.hf_ropes(cfg, VARIANT.rotary, opts)[FULL]
        self.model = Backbone(cfg, opts, dtype)
        self.tied = bool(cfg.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.state_dict_hooks = (self._drop_tied_head, self._split_q_gate, self._offset_norms)
        if opts.conv == "window":
            self.state_dict_hooks += (lambda sd: time_major_conv(sd, ".linear_attn.conv1d.weight"),)
        if opts.fold_norms:
            self.state_dict_hooks += (self._fold_norms,)
        if any(layer.is_attention and layer.self_attn.fused for layer in self.model.layers):
            self.state_dict_hooks += (self._fuse_qk,)  # after the fold, which writes q/k_proj

    def _drop_tied_head(self, sd: dict) -> None:
        if self.tied:
            sd.pop("lm_head.weight", None)

    def _split_q_gate(self, sd: dict) -> None:
        """q_proj (per head: its query rows, then its gate rows) -> q_proj and g_proj."""
        for i, layer in enumerate(self.model.layers):
            key = f"model.layers.{i}.self_attn.q_proj.weight"
            if not layer.is_attention or key not in sd:
                continue
            attn, w = layer.self_attn, sd.pop(key)
            rows = 2 * attn.n_heads * attn.head_dim
            if w.shape[0] != rows:
                raise InputError(f"Checkpoint tensor {key} has shape {tuple(w.shape)}; expected "
                                 f"{rows} rows (a query and a gate per head). Check that the "
                                 "weights and config.json come from the same model.")
            q, g = w.view(attn.n_heads, 2, attn.head_dim, -1).unbind(1)
            sd[key] = q.reshape(rows // 2, -1)
            sd[key.replace(".q_proj.", ".g_proj.")] = g.reshape(rows // 2, -1)

    @staticmethod
    def _offset_norms(sd: dict) -> None:
        for key in [k for k in sd if k.endswith(OFFSET_NORMS) or k == "model.norm.weight"]:
            sd[key] = sd[key].float() + 1.0

    def _fold_norms(self, sd: dict) -> None:
        """Each block's input norm into its mixer's projections, its second norm into the
        feed-forward's gate and up projections."""
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            fold_norm(sd, f"{p}.input_layernorm",
                      [f"{p}.self_attn.{n}_proj" for n in "qkvg"] if layer.is_attention else
                      [f"{p}.linear_attn.in_proj_{n}" for n in ("qkv", "z", "b", "a")])
            fold_norm(sd, f"{p}.post_attention_layernorm", [f"{p}.mlp.gate_proj",
                                                            f"{p}.mlp.up_proj"])

    def _fuse_qk(self, sd: dict) -> None:
        for i, layer in enumerate(self.model.layers):
            if layer.is_attention:
                attn = layer.self_attn
                fuse_qk_weights(sd, f"model.layers.{i}.self_attn", ("q_norm", "k_norm"),
                                attn.n_heads, attn.n_kv)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return run_decoder(self, tokens, input_pos, self.model.norm, head_weight(self))


def build(cfg, opts: ModelOptions, dtype) -> Qwen3_5ForCausalLM:
    with torch.device("meta"):
        return Qwen3_5ForCausalLM(cfg, opts, dtype)


def _text_tower(cfg, state_dict: dict):
    """(Qwen3_5Config, its state dict) -> the text decoder's. Whether the head is tied is the
    outer config's to say."""
    text = cfg.text_config
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    return text, text_tensors(state_dict, (("model.language_model.", "model."),
                                           ("lm_head.", "lm_head.")))


# --- ExecuTorch's export_llm: Meta names, params JSON, model classes ---------------------------

def _params_problems(p: dict, model_class: str) -> list[str]:
    out = layer_kinds(p, KINDS)
    flags = ("use_hf_rope", "use_qk_norm", "qk_norm_before_rope", "use_q_gate",
             "rms_norm_add_unit_offset")
    if not all(p[f] for f in flags):
        out.append(f"{', '.join(flags[:-1])} and {flags[-1]} must all be true, as in "
                   "ExecuTorch's qwen3_5 configs")
    if p["use_scaled_rope"]:
        out.append(llama.UNSCALED_ROPE)
    return out


def _config(p: dict, model_class: str, common: dict, tied: bool):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **common, rms_norm_eps=p["norm_eps"], head_dim=p["head_dim"], tie_word_embeddings=tied,
        attention_bias=False, layer_types=list(p["layer_types"][:p["n_layers"]]),
        rope_parameters={**llama.default_rope(p),
                         "partial_rotary_factor": float(p["partial_rotary_factor"])},
        **linear_sizes(p))


def linear_sizes(p: dict) -> dict:
    """The DeltaNet sizes as ModelArgs derives those left out: head dims from head_dim, head
    counts from n_heads."""
    derived = {"linear_key_head_dim": p["head_dim"], "linear_value_head_dim": p["head_dim"],
               "linear_num_key_heads": p["n_heads"], "linear_num_value_heads": p["n_heads"]}
    return {f: p[f] if p[f] is not None else derived[f] for f in LINEAR}


_META = {"attention.q_norm_fn.weight": "self_attn.q_norm.weight",
         "attention.k_norm_fn.weight": "self_attn.k_norm.weight",
         **{f"attention.{n}": f"linear_attn.{n}" for n in (
             "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
             "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")}}

ARCHITECTURE = Architecture(
    model_type="qwen3_5_text", summary="Qwen3.5 text decoders (gated DeltaNet + gated attention)",
    build=build, check=check, unsupported=unsupported,
    # a text folder may still hold a multi-token-prediction head (mtp.*), which is left out
    tower=lambda cfg, sd: (cfg, text_tensors(sd, (("model.", "model."), ("lm_head.", "lm_head.")))),
    executorch=llama.meta_layout(
        ("qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b"), _META, _params_problems, _config,
        reads=("partial_rotary_factor", "use_q_gate", "rms_norm_add_unit_offset", *LINEAR)))
TOWER = dataclasses.replace(
    ARCHITECTURE, model_type="qwen3_5", tower=_text_tower, executorch=None,
    summary="Qwen3.5 multimodal folders: their text decoder (the vision tower is left out)")
ARCHITECTURES = (ARCHITECTURE, TOWER)
