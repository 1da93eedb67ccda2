"""ExecuTorch `export_llm` checkpoints: a `.pth` state dict in Meta's names, the params JSON that
export_llm reads as `base.params` (fields of ExecuTorch's ModelArgs), and `base.model_class`.

The reference, ExecuTorch 1.5.1's examples/models/*/convert_weights.py, goes from Hugging Face
names to Meta's; this goes back, so the HF-named architectures load the weights as they are:
params become a transformers config as ModelArgs.__post_init__ and llama/model.py derive them;
q/k rows are un-permuted when use_hf_rope is false; output.weight equal to tok_embeddings.weight
means tied embeddings. What differs per architecture (its model classes, Meta names, the params
it takes, its transformers config) is its `ExecuTorchLayout` (architectures/).
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

from ..architectures.registry import every, for_model_class
from ..errors import InputError
from ..memory import note_mapped
from .base import Source

# ModelArgs fields read here, at ModelArgs' defaults (None: derived as __post_init__ does)
_READ = dict(dim=None, n_layers=None, n_heads=None, vocab_size=None, n_kv_heads=None,
             hidden_dim=None, head_dim=None, multiple_of=256, ffn_dim_multiplier=None,
             norm_eps=1e-5, rope_theta=None, rope_freq_base=10000.0, use_scaled_rope=False,
             rope_scale_factor=8, high_freq_factor=4, use_hf_rope=False, use_qk_norm=False,
             qk_norm_before_rope=False, attention_qkv_bias=False, layer_types=None,
             partial_rotary_factor=1.0, rope_scaling_short_factor=None,
             rope_scaling_long_factor=None, original_max_position_embeddings=None,
             max_position_embeddings=None, use_q_gate=False, rms_norm_add_unit_offset=False,
             linear_conv_kernel_dim=4, linear_key_head_dim=None, linear_value_head_dim=None,
             linear_num_key_heads=None, linear_num_value_heads=None)
_LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
           "linear_num_key_heads", "linear_num_value_heads")  # Qwen3.5's DeltaNet sizes
# fields only some architectures read (ExecuTorchLayout.reads); elsewhere only at their default
_OPTIONAL = ("partial_rotary_factor", "rope_scaling_short_factor", "rope_scaling_long_factor",
             "original_max_position_embeddings", "use_q_gate", "rms_norm_add_unit_offset",
             *_LINEAR)
_REQUIRED = ("dim", "n_layers", "n_heads", "vocab_size")
_INTS = {"dim", "n_layers", "n_heads", "vocab_size", "n_kv_heads", "hidden_dim", "head_dim",
         "multiple_of", "rope_scale_factor", "high_freq_factor",
         "original_max_position_embeddings", "max_position_embeddings", *_LINEAR}
_LISTS = {"rope_scaling_short_factor", "rope_scaling_long_factor"}
_FLAGS = {"use_scaled_rope", "use_hf_rope", "use_qk_norm", "qk_norm_before_rope",
          "attention_qkv_bias", "use_q_gate", "rms_norm_add_unit_offset"}
# Fields about the export or the runtime, or that only matter beside a refused feature (moe,
# LongRoPE, LoRA): they do not change what the architectures compute.
_IGNORED = {"max_batch_size", "max_seq_len", "max_context_len", "use_kv_cache", "device",
            "use_sdpa_with_kv_cache_op", "generate_full_logits", "enable_dynamic_shape",
            "bos_idx", "eos_idx", "bos_count", "eos_count", "model_architecture", "use_ffn_norm",
            "kv_io_bit_width", "peft_type", "base_model_name_or_path",
            "num_experts", "num_activated_experts", "moe_hidden_dim", "moe_use_expert_bias",
            "moe_shared_expert_hidden_dim", "moe_score_func", "moe_route_scale"}
# Fields that change the function: accepted only at their ModelArgs default
_FIXED = dict(
    qk_norm_affine=True, moe=False,
    attention_type="mha", norm_type="rmsnorm", act_fn="silu",
    attention_multiplier=None, post_attention_norm=False, post_ffn_norm=False, output_bias=False,
    logits_scaling=None, input_prune_map=None, output_prune_map=None,
    apply_embedding=True, embedding_scale_factor=1.0, apply_output=True, residual_multiplier=None,
    no_rope_layer_interval=None, local_rope_theta=None, rope_scaling_attention_factor=None,
    quantization_args=None, lora_args=None, r=None,
    lora_alpha=None, target_modules=None, attention_kwargs={}, mlp_type=None,
    sliding_window=None, num_kv_shared_layers=0, final_logit_softcapping=None,
    attn_logit_softcapping=None, normalize_tok_embeddings=False, scale_query_by=1.0,
    use_attn_o_gate=False, use_attn_o_norm=False, use_residual_gate=False,
    use_ffn_learnable_scales=False, output_soft_cap_temp=None, output_linear_intermediate_dim=0)
_KNOWN = sorted({*_READ, *_IGNORED, *_FIXED})

# State an ExecuTorch model.state_dict() or a Meta consolidated .pth carries beside the weights
_BUFFERS = re.compile(r"^rope\.freqs$|\.conv_state$|\.recurrent_state$|\.kv_cache\.[kv]_cache$"
                      r"|\.mask$")


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
    elif key in _LISTS:
        ok = isinstance(value, list) and value and all(type(v) in (int, float) for v in value)
        want = "a list of numbers"
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


def hf_config_from_params(params: dict, model_class: str, *, tie_word_embeddings: bool = False,
                          origin: str = "ExecuTorch params JSON"):
    """ExecuTorch params + base.model_class -> the transformers config of its architecture.
    Heads are tied only when told (ExecuTorch's Transformer has its own output projection; its
    converters write the embedding there for tied models), or always where the architecture
    says so."""
    arch = for_model_class(model_class)
    layout = arch.executorch
    p = _resolve(params, origin)
    problems = layout.problems(p, model_class) + [
        f"{k}={p[k]!r} is not supported by {arch.model_type} (only {_READ[k]!r})"
        for k in _OPTIONAL if k not in layout.reads and p[k] != _READ[k]]
    if p["attention_qkv_bias"] and not layout.qkv_bias:
        having = "; ".join(f"{a.model_type} has: model_class "
                           f"{' or '.join(a.executorch.model_classes)}"
                           for a in every() if a.executorch and a.executorch.qkv_bias)
        problems.append(f"attention_qkv_bias=true: {arch.model_type} has no q/k/v biases "
                        f"({having})")
    if problems:
        raise InputError(f"{origin} does not fit edgellm's {arch.model_type} (model_class "
                         f"{model_class}): {'; '.join(problems)}. Fix the params JSON or the "
                         "model_class.")
    common = dict(vocab_size=p["vocab_size"], hidden_size=p["dim"],
                  intermediate_size=p["hidden_dim"], num_hidden_layers=p["n_layers"],
                  num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"],
                  bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  # a .pth names its trained context only where its params say
                  max_position_embeddings=p["max_position_embeddings"] or 131072)
    return layout.config(p, model_class, common, tie_word_embeddings)


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


def _hf_state_dict(sd: dict, layout, p: dict) -> dict:
    """Meta names -> HF names. Buffers are dropped, unknown tensors kept under their own names
    (the model loader names them), output.weight dropped when it is the embedding."""
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": layout.final_norm,
           "output.weight": None if _tied(sd) else "lm_head.weight"}
    out = {}
    for key, value in layout.join(sd).items():
        m = re.match(r"layers\.(\d+)\.(.+)$", key)
        if _BUFFERS.search(key) or (key in top and top[key] is None):
            continue
        if key in top:
            out[top[key]] = value
        elif m and m[2] in layout.layer_names:
            if not p["use_hf_rope"] and m[2] in ("attention.wq.weight", "attention.wk.weight"):
                value = _unpermute_rows(value, p["n_heads" if "wq" in m[2] else "n_kv_heads"])
            out[f"model.layers.{m[1]}.{layout.layer_names[m[2]]}"] = value
        else:
            out[key] = value
    return out


def load_executorch(checkpoint: Path, params_path: Path, model_class: str) -> Source:
    """A .pth state dict + params JSON + base.model_class, as Hugging Face config and names.
    No tokenizer and no BOS/EOS ids: ExecuTorch keeps those in other files (base.metadata)."""
    arch = for_model_class(model_class)
    layout = arch.executorch
    params = read_params(Path(params_path))
    sd = _read_checkpoint(Path(checkpoint))
    tied = _tied(sd)
    if layout.always_tied and tied is False:
        raise InputError(f"{checkpoint}: output.weight differs from tok_embeddings.weight, but "
                         f"{layout.always_tied}. Check that the checkpoint is a {arch.model_type} "
                         f"({model_class}) one.")
    cfg = hf_config_from_params(params, model_class, tie_word_embeddings=bool(tied),
                                origin=str(params_path))
    state = _hf_state_dict(sd, layout, _resolve(params, str(params_path)))
    return Source(hf_config=cfg, state_dict=state, origin=str(checkpoint))
