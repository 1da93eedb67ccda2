"""ExecuTorch `export_llm` checkpoints: a `.pth` state dict in Meta's names, the params JSON that
export_llm reads as `base.params` (fields of ExecuTorch's ModelArgs), and `base.model_class`.

The reference, ExecuTorch 1.5.1's examples/models/*/convert_weights.py, goes from Hugging Face
names to Meta's; this goes back, so the HF-named architectures load the weights as they are:
params become a transformers config as ModelArgs.__post_init__ and llama/model.py derive them;
LFM2's B/C/x projections are concatenated back into `conv.in_proj`; q/k rows are un-permuted when
use_hf_rope is false; output.weight equal to tok_embeddings.weight means tied embeddings.
Unlike ExecuTorch's loader, which ignores unknown params keys and tensors (strict=False), an
unknown key or a ModelArgs field set to something the architectures do not compute is refused,
unknown tensors reach the model loader (which names them), and the .pth is opened with
weights_only=True.
"""

from __future__ import annotations

import difflib
import json
import pickle
import re
from pathlib import Path

import torch

from ..errors import InputError
from ..progress import note_mapped
from . import Source

# ExecuTorch's ModelType (extension/llm/export/config/llm_config.py) -> edgellm architecture
MODEL_CLASSES = {**dict.fromkeys(("lfm2_350m", "lfm2_700m", "lfm2_1_2b", "lfm2_5_350m",
                                  "lfm2_5_1_2b"), "lfm2"),
                 **dict.fromkeys(("stories110m", "llama2", "llama3", "llama3_1", "llama3_2",
                                  "smollm2"), "llama"),
                 **dict.fromkeys(("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_coder_32b"), "qwen2"),
                 **dict.fromkeys(("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b"), "qwen3")}
UNSUPPORTED_CLASSES = {
    **dict.fromkeys(("qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b"), "Qwen3.5 (gated DeltaNet "
                    "linear-attention layers): edgellm has no qwen3_5 architecture yet"),
    "phi_4_mini": "Phi-4-mini (partial rotary, LongRoPE): edgellm has no phi3 architecture yet",
    "llama3_2_vision": "a torchtune multimodal decoder: edgellm has no vision architecture",
    "static_llama": "Qualcomm's static-shape wrapper, not a weights layout: give the class the "
                    "checkpoint was trained as (e.g. llama3_2)"}

# ModelArgs fields read here, at ModelArgs' defaults (None: derived as __post_init__ does)
_READ = dict(dim=None, n_layers=None, n_heads=None, vocab_size=None, n_kv_heads=None,
             hidden_dim=None, head_dim=None, multiple_of=256, ffn_dim_multiplier=None,
             norm_eps=1e-5, rope_theta=None, rope_freq_base=10000.0, use_scaled_rope=False,
             rope_scale_factor=8, high_freq_factor=4, use_hf_rope=False, use_qk_norm=False,
             qk_norm_before_rope=False, attention_qkv_bias=False, layer_types=None)
_REQUIRED = ("dim", "n_layers", "n_heads", "vocab_size")
_INTS = {"dim", "n_layers", "n_heads", "vocab_size", "n_kv_heads", "hidden_dim", "head_dim",
         "multiple_of", "rope_scale_factor", "high_freq_factor"}
_FLAGS = {"use_scaled_rope", "use_hf_rope", "use_qk_norm", "qk_norm_before_rope",
          "attention_qkv_bias"}
# Fields about the export or the runtime, or that only matter beside a refused feature (moe,
# linear-attention layers, LongRoPE, LoRA): they do not change what lfm2/llama compute.
_IGNORED = {"max_batch_size", "max_seq_len", "max_context_len", "use_kv_cache", "device",
            "use_sdpa_with_kv_cache_op", "generate_full_logits", "enable_dynamic_shape",
            "bos_idx", "eos_idx", "bos_count", "eos_count", "model_architecture", "use_ffn_norm",
            "max_position_embeddings", "kv_io_bit_width", "peft_type", "base_model_name_or_path",
            "num_experts", "num_activated_experts", "moe_hidden_dim", "moe_use_expert_bias",
            "moe_shared_expert_hidden_dim", "moe_score_func", "moe_route_scale",
            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads"}
# Fields that change the function: accepted only at their ModelArgs default
_FIXED = dict(
    qk_norm_affine=True, partial_rotary_factor=1.0, moe=False,
    attention_type="mha", norm_type="rmsnorm", act_fn="silu", rms_norm_add_unit_offset=False,
    attention_multiplier=None, post_attention_norm=False, post_ffn_norm=False, output_bias=False,
    use_q_gate=False, logits_scaling=None, input_prune_map=None, output_prune_map=None,
    apply_embedding=True, embedding_scale_factor=1.0, apply_output=True, residual_multiplier=None,
    no_rope_layer_interval=None, local_rope_theta=None, rope_scaling_short_factor=None,
    rope_scaling_long_factor=None, original_max_position_embeddings=None,
    rope_scaling_attention_factor=None, quantization_args=None, lora_args=None, r=None,
    lora_alpha=None, target_modules=None, attention_kwargs={}, mlp_type=None,
    sliding_window=None, num_kv_shared_layers=0, final_logit_softcapping=None,
    attn_logit_softcapping=None, normalize_tok_embeddings=False, scale_query_by=1.0,
    use_attn_o_gate=False, use_attn_o_norm=False, use_residual_gate=False,
    use_ffn_learnable_scales=False, output_soft_cap_temp=None, output_linear_intermediate_dim=0)
_KNOWN = sorted({*_READ, *_IGNORED, *_FIXED})

# Meta name -> HF name, inside "layers.N." on both sides; top-level names beside them
_QKV = {f"attention.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"}
_LAYER_NAMES = {
    "lfm2": {**_QKV, "attention.wo.weight": "self_attn.out_proj.weight",
             "attention.q_norm_fn.weight": "self_attn.q_layernorm.weight",
             "attention.k_norm_fn.weight": "self_attn.k_layernorm.weight",
             "attention_norm.weight": "operator_norm.weight",
             **{k: k for k in ("ffn_norm.weight", "conv.conv.weight", "conv.out_proj.weight",
                               "feed_forward.w1.weight", "feed_forward.w2.weight",
                               "feed_forward.w3.weight")}},
    "llama": {**_QKV, "attention.wo.weight": "self_attn.o_proj.weight",
              "attention_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight",
              "feed_forward.w1.weight": "mlp.gate_proj.weight",
              "feed_forward.w2.weight": "mlp.down_proj.weight",
              "feed_forward.w3.weight": "mlp.up_proj.weight"}}
_LAYER_NAMES["qwen2"] = {**_LAYER_NAMES["llama"],
                         **{f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}}
_LAYER_NAMES["qwen3"] = {**_LAYER_NAMES["llama"],
                         "attention.q_norm_fn.weight": "self_attn.q_norm.weight",
                         "attention.k_norm_fn.weight": "self_attn.k_norm.weight"}
_FINAL_NORM = {"lfm2": "model.embedding_norm.weight", "llama": "model.norm.weight",
               "qwen2": "model.norm.weight", "qwen3": "model.norm.weight"}
_CONV_PARTS = ("conv.B_proj.weight", "conv.C_proj.weight", "conv.x_proj.weight")  # LFM2 only
# State an ExecuTorch model.state_dict() or a Meta consolidated .pth carries beside the weights
_BUFFERS = re.compile(r"^rope\.freqs$|\.conv_state$|\.kv_cache\.[kv]_cache$|\.mask$")


def architecture_of(model_class: str) -> str:
    """The edgellm architecture of an ExecuTorch base.model_class; InputError saying why not."""
    if model_class in MODEL_CLASSES:
        return MODEL_CLASSES[model_class]
    supported = f"Supported: {', '.join(MODEL_CLASSES)}."
    if model_class in UNSUPPORTED_CLASSES:
        raise InputError(f"ExecuTorch model_class '{model_class}' is not supported: "
                         f"{UNSUPPORTED_CLASSES[model_class]}. {supported}")
    close = difflib.get_close_matches(str(model_class), MODEL_CLASSES, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise InputError(f"Unknown ExecuTorch model_class '{model_class}'.{hint} {supported} "
                     "Run `edgellm models` to see every architecture.")


def _key_problem(key: str, value) -> str | None:
    if key in _IGNORED:
        return None
    if key in _FIXED:
        return None if value == _FIXED[key] else (
            f"{key}={value!r} is not supported (only {_FIXED[key]!r})")
    if key not in _READ:
        close = difflib.get_close_matches(key, _KNOWN, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"unknown key '{key}'{hint}: not a field of ExecuTorch's ModelArgs"
    if value is None and _READ[key] is None and key not in _REQUIRED:
        return None
    if key in _FLAGS:
        ok, want = isinstance(value, bool), "true or false"
    elif key in _INTS:
        ok, want = type(value) is int and value > 0, "a positive integer"
    elif key == "layer_types":
        ok = isinstance(value, list) and all(isinstance(k, str) for k in value)
        want = "a list of layer kinds"
    else:
        ok, want = type(value) in (int, float), "a number"
    return None if ok else f"{key}={value!r} must be {want}"


def _resolve(params: dict, origin: str) -> dict:
    """Every ModelArgs field this file reads, filled in as ModelArgs.__post_init__ does."""
    if not isinstance(params, dict):
        raise InputError(f"{origin} must be a JSON object of ModelArgs fields, not "
                         f"{type(params).__name__}.")
    problems = [f"missing required key {k}" for k in _REQUIRED if k not in params]
    problems += filter(None, (_key_problem(k, v) for k, v in params.items()))
    if problems:
        raise InputError(f"{origin}: {'; '.join(problems)}. Fix the params JSON (ExecuTorch's "
                         "base.params); examples ship in executorch/examples/models/*/config.")
    p = {**_READ, **{k: v for k, v in params.items() if k in _READ}}
    p["n_kv_heads"] = p["n_kv_heads"] or p["n_heads"]
    p["rope_freq_base"] = p["rope_theta"] or p["rope_freq_base"]
    p["head_dim"] = p["head_dim"] or p["dim"] // p["n_heads"]
    if p["hidden_dim"] is None:
        hidden = int(2 * (4 * p["dim"]) / 3)
        if p["ffn_dim_multiplier"] is not None:
            hidden = int(p["ffn_dim_multiplier"] * hidden)
        p["hidden_dim"] = -(-hidden // p["multiple_of"]) * p["multiple_of"]
    return p


def _layer_kinds(p: dict, allowed: tuple[str, ...]) -> list[str]:
    # ExecuTorch reads layer_types[i] for i < n_layers: the upstream lfm2_350m/700m/1_2b JSONs
    # list 17 kinds for 16 layers and the 17th is never read; fewer than n_layers would crash.
    kinds, n = p["layer_types"] or [], p["n_layers"]
    odd = sorted(set(kinds[:n]) - set(allowed))
    return ([f"layer_types has {len(kinds)} entries for n_layers {n}; one kind per layer is "
             "needed"] if len(kinds) < n else []) + (
        [f"layer_types holds {odd}; allowed: {', '.join(allowed)}"] if odd else [])


def _lfm2_problems(p: dict, model_class: str) -> list[str]:
    out = _layer_kinds(p, ("conv", "full_attention"))
    if not (p["use_hf_rope"] and p["use_qk_norm"] and p["qk_norm_before_rope"]):
        out.append("use_hf_rope, use_qk_norm and qk_norm_before_rope must all be true, as in "
                   "ExecuTorch's lfm2 configs (LFM2 normalises q and k before half-split RoPE)")
    if p["head_dim"] * p["n_heads"] != p["dim"]:
        out.append(f"head_dim {p['head_dim']} must be dim / n_heads = {p['dim'] / p['n_heads']}")
    return out


UNSCALED_ROPE = "use_scaled_rope=true: ExecuTorch scales RoPE only for Meta-layout Llamas"


def _attention_kinds(p: dict) -> list[str]:
    """Llama and Qwen: every layer an attention layer, where the params name layer kinds."""
    return _layer_kinds(p, ("full_attention",)) if p["layer_types"] is not None else []


def _llama_problems(p: dict, model_class: str) -> list[str]:
    out = _attention_kinds(p)
    if p["use_qk_norm"]:
        out.append("use_qk_norm=true: Llama has no q/k norms (Qwen3 has: model_class "
                   "qwen3_0_6b, qwen3_1_7b or qwen3_4b)")
    if p["use_scaled_rope"] and not p["use_hf_rope"] and model_class in ("llama2", "stories110m"):
        out.append(f"use_scaled_rope=true is refused by ExecuTorch for {model_class}")
    return out


def _qwen2_problems(p: dict, model_class: str) -> list[str]:
    out = _attention_kinds(p)
    if not (p["use_hf_rope"] and p["attention_qkv_bias"]) or p["use_qk_norm"]:
        out.append("use_hf_rope and attention_qkv_bias must be true and use_qk_norm false, as in "
                   "ExecuTorch's qwen2_5 configs (Qwen2 has biases on q, k and v and no q/k "
                   "norms)")
    if p["head_dim"] * p["n_heads"] != p["dim"]:
        out.append(f"head_dim {p['head_dim']} must be dim / n_heads = {p['dim'] / p['n_heads']}")
    if p["use_scaled_rope"]:
        out.append(UNSCALED_ROPE)
    return out


def _qwen3_problems(p: dict, model_class: str) -> list[str]:
    out = _attention_kinds(p)
    if not (p["use_hf_rope"] and p["use_qk_norm"] and p["qk_norm_before_rope"]):
        out.append("use_hf_rope, use_qk_norm and qk_norm_before_rope must all be true, as in "
                   "ExecuTorch's qwen3 configs (Qwen3 normalises each q and k head before "
                   "half-split RoPE)")
    if p["use_scaled_rope"]:
        out.append(UNSCALED_ROPE)
    return out


def _llama_rope(p: dict, model_class: str) -> dict:
    # ExecuTorch scales RoPE only on its own (use_hf_rope false) path, as Llama 3 does at original
    # length 8192 with low_freq_factor 1 (rope.py apply_scaling); model.py forces the factor to
    # 32 for classes other than llama3 and llama3_1.
    if not p["use_scaled_rope"] or p["use_hf_rope"]:
        return {"rope_type": "default", "rope_theta": float(p["rope_freq_base"])}
    factor = p["rope_scale_factor"] if model_class in ("llama3", "llama3_1") else 32
    return {"rope_type": "llama3", "rope_theta": float(p["rope_freq_base"]),
            "factor": float(factor), "low_freq_factor": 1.0,
            "high_freq_factor": float(p["high_freq_factor"]),
            "original_max_position_embeddings": 8192}


def hf_config_from_params(params: dict, model_class: str, *, tie_word_embeddings: bool = False,
                          origin: str = "ExecuTorch params JSON"):
    """ExecuTorch params + base.model_class -> Lfm2Config, LlamaConfig, Qwen2Config or
    Qwen3Config. LFM2 is always tied; the others only when told (ExecuTorch's Transformer has
    its own output projection; its qwen converters write the embedding there for tied models)."""
    arch = architecture_of(model_class)
    p = _resolve(params, origin)
    problems = {"lfm2": _lfm2_problems, "llama": _llama_problems, "qwen2": _qwen2_problems,
                "qwen3": _qwen3_problems}[arch](p, model_class)
    if p["attention_qkv_bias"] and arch != "qwen2":
        problems.append(f"attention_qkv_bias=true: {arch} has no q/k/v biases (Qwen2.5 has: "
                        "model_class qwen2_5_0_5b, qwen2_5_1_5b or qwen2_5_coder_32b)")
    if problems:
        raise InputError(f"{origin} does not fit edgellm's {arch} (model_class {model_class}): "
                         f"{'; '.join(problems)}. Fix the params JSON or the model_class.")
    common = dict(vocab_size=p["vocab_size"], hidden_size=p["dim"],
                  intermediate_size=p["hidden_dim"], num_hidden_layers=p["n_layers"],
                  num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"],
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "lfm2":
        from transformers import Lfm2Config

        return Lfm2Config(**common, norm_eps=p["norm_eps"], tie_word_embeddings=True,
                          layer_types=list(p["layer_types"][:p["n_layers"]]),
                          rope_parameters={"rope_type": "default",
                                           "rope_theta": float(p["rope_freq_base"])},
                          conv_L_cache=3, conv_bias=False,  # ShortConv's fixed kernel, no bias
                          block_auto_adjust_ff_dim=False)  # hidden_dim is already the width
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, rms_norm_eps=p["norm_eps"],
                           rope_parameters={"rope_type": "default",
                                            "rope_theta": float(p["rope_freq_base"])},
                           tie_word_embeddings=tie_word_embeddings)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, rms_norm_eps=p["norm_eps"], head_dim=p["head_dim"],
                           rope_parameters={"rope_type": "default",
                                            "rope_theta": float(p["rope_freq_base"])},
                           tie_word_embeddings=tie_word_embeddings, attention_bias=False)
    from transformers import LlamaConfig

    rope = _llama_rope(p, model_class)
    if rope["rope_type"] == "llama3":  # transformers wants it above the original 8192
        common["max_position_embeddings"] = 131072
    return LlamaConfig(**common, rms_norm_eps=p["norm_eps"], head_dim=p["head_dim"],
                       rope_parameters=rope, tie_word_embeddings=tie_word_embeddings,
                       attention_bias=False, mlp_bias=False)


def read_params(path: Path) -> dict:
    if not path.is_file():
        raise InputError(f"ExecuTorch params file {path} does not exist. Give the params JSON "
                         "the checkpoint was exported with (ExecuTorch's base.params).")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not readable JSON ({e}). Restore the params file the "
                         "checkpoint came with.") from None


def _read_checkpoint(path: Path) -> dict:
    """The .pth's state dict, memory-mapped; {"model": sd} is unwrapped as llama/model.py does."""
    if not path.is_file():
        raise InputError(f"ExecuTorch checkpoint {path} does not exist.")
    try:
        obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        note_mapped([path])
    except pickle.UnpicklingError as e:  # what weights_only raises on anything but tensors
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise InputError(f"{path} holds pickled objects that are not tensors"
                         f"{f' ({found[1]})' if found else ''}; edgellm opens .pth files with "
                         "torch.load(weights_only=True) and runs no code from them. Save the "
                         "state dict alone: torch.save(model.state_dict(), path).") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise InputError(f"{path} is not a readable PyTorch checkpoint "
                         f"({str(e).splitlines()[0]}). It may be truncated: copy it again, or "
                         "save it with torch.save(state_dict, path).") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    bad = [str(k) for k, v in obj.items() if not (isinstance(k, str) and isinstance(
        v, torch.Tensor))] if isinstance(obj, dict) else None
    if bad is None or bad:
        found = f"non-tensor entries {bad[:8]}" if bad else f"a {type(obj).__name__}"
        raise InputError(f"{path} is not a state dict (it holds {found}). Save "
                         "model.state_dict() with torch.save.")
    return obj


def _tied(sd: dict) -> bool | None:
    """None when the checkpoint has no output.weight to decide by."""
    out, emb = sd.get("output.weight"), sd.get("tok_embeddings.weight")
    if out is None:
        return None
    return (emb is not None and out.shape == emb.shape and out.dtype == emb.dtype
            and (out.data_ptr() == emb.data_ptr() or torch.equal(out, emb)))


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Meta's checkpoints (and torchtune's hf_to_tune, which SmolLM2's converter goes through)
    # order each head's q/k rows for interleaved RoPE, which rotates pairs (2i, 2i+1); HF rotates
    # halves (i, i + head_dim/2). Regrouping the rows makes HF's RoPE compute the same function;
    # it is the permutation ExecuTorch's StaticAttention.adopt_hf_rope applies. (n*hd, in)
    return w.reshape(n_heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def _hf_state_dict(sd: dict, arch: str, p: dict) -> dict:
    """Meta names -> HF names. Buffers are dropped, unknown tensors kept under their own names
    (the model loader names them), output.weight dropped when it is the embedding."""
    names = _LAYER_NAMES[arch]
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": _FINAL_NORM[arch],
           "output.weight": None if _tied(sd) else "lm_head.weight"}
    out, convs = {}, {}
    for key, value in sd.items():
        m = re.match(r"layers\.(\d+)\.(.+)$", key)
        if _BUFFERS.search(key) or (key in top and top[key] is None):
            continue
        if key in top:
            out[top[key]] = value
        elif m and arch == "lfm2" and m[2] in _CONV_PARTS:
            convs.setdefault(m[1], {})[m[2]] = (key, value)
        elif m and m[2] in names:
            if not p["use_hf_rope"] and m[2] in ("attention.wq.weight", "attention.wk.weight"):
                value = _unpermute_rows(value, p["n_heads" if "wq" in m[2] else "n_kv_heads"])
            out[f"model.layers.{m[1]}.{names[m[2]]}"] = value
        else:
            out[key] = value
    for layer, parts in convs.items():
        if len(parts) == 3:  # lfm_2_to_meta: torch.chunk(in_proj, 3) -> B, C, x
            out[f"model.layers.{layer}.conv.in_proj.weight"] = torch.cat(
                [parts[k][1] for k in _CONV_PARTS])
        else:  # left for the loader to name
            out.update(parts.values())
    return out


def load_executorch(checkpoint: Path, params_path: Path, model_class: str) -> Source:
    """A .pth state dict + params JSON + base.model_class, as Hugging Face config and names.
    No tokenizer and no BOS/EOS ids: ExecuTorch keeps those in other files (base.metadata)."""
    arch = architecture_of(model_class)
    params = read_params(Path(params_path))
    sd = _read_checkpoint(Path(checkpoint))
    tied = _tied(sd)
    if arch == "lfm2" and tied is False:
        raise InputError(f"{checkpoint}: output.weight differs from tok_embeddings.weight, but "
                         "LFM2 ties its output head to the embedding. Check that the checkpoint "
                         f"is an LFM2 ({model_class}) one.")
    cfg = hf_config_from_params(params, model_class, tie_word_embeddings=bool(tied),
                                origin=str(params_path))
    state = _hf_state_dict(sd, arch, _resolve(params, str(params_path)))
    return Source(hf_config=cfg, state_dict=state, origin=str(checkpoint))
