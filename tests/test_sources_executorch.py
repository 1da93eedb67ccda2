"""ExecuTorch .pth + params JSON as a model source: parity with transformers and with ExecuTorch's
own eager model, the upstream LFM2 params, and the refusals."""

import copy
import json
import pathlib
from pathlib import Path

import pytest
import torch

from conftest import assert_logits_close, cached_run, reference_run
from edgellm.architectures import build_model, every
from edgellm.architectures.layers import ModelOptions
from edgellm.architectures.registry import REFUSED_CLASSES
from edgellm.errors import InputError
from edgellm.sources.executorch import hf_config_from_params, load_executorch

REFERENCE_PARAMS = Path(__file__).parent / "data" / "executorch-lfm2-params"

# The inverse of the source's rename for Llama (ExecuTorch ships no HF -> Meta converter for it
# that imports without torchtune); q/k rows stay in HF order, so the params say use_hf_rope.
LLAMA_TO_META = {"model.embed_tokens.weight": "tok_embeddings.weight",
                 "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight",
                 "self_attn.q_proj.weight": "attention.wq.weight",
                 "self_attn.k_proj.weight": "attention.wk.weight",
                 "self_attn.v_proj.weight": "attention.wv.weight",
                 "self_attn.o_proj.weight": "attention.wo.weight",
                 "input_layernorm.weight": "attention_norm.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "feed_forward.w1.weight",
                 "mlp.down_proj.weight": "feed_forward.w2.weight",
                 "mlp.up_proj.weight": "feed_forward.w3.weight"}


# ExecuTorch's qwen2_5 converter adds the q/k/v biases (it imports torchtune, so not used here)
QWEN2_TO_META = LLAMA_TO_META | {f"self_attn.{x}_proj.bias": f"attention.w{x}.bias" for x in "qkv"}


def llama_to_meta(sd: dict, names: dict = LLAMA_TO_META) -> dict:
    out = {}
    for key, value in sd.items():
        if key.startswith("model.layers."):
            _, _, layer, rest = key.split(".", 3)
            out[f"layers.{layer}.{names[rest]}"] = value
        else:
            out[names[key]] = value
    return out


def params_for(cfg, **extra) -> dict:
    return dict(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
                n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                vocab_size=cfg.vocab_size, hidden_dim=cfg.intermediate_size,
                ffn_dim_multiplier=1, rope_theta=cfg.rope_parameters["rope_theta"],
                use_scaled_rope=False, **extra)


def write_lfm2(folder, hf, out: Path):
    """ExecuTorch's own convert_weights on the tiny folder, and a params JSON as upstream
    writes them (one layer kind too many, like lfm2_350m_config.json)."""
    from executorch.examples.models.lfm2.convert_weights import convert_weights

    convert_weights(str(folder), str(out / "model.pth"))
    cfg = hf.config
    params = params_for(cfg, norm_eps=cfg.norm_eps, use_hf_rope=True, use_qk_norm=True,
                        qk_norm_before_rope=True, layer_types=[*cfg.layer_types, "conv"])
    (out / "params.json").write_text(json.dumps(params))
    return "lfm2_350m", hf


def write_llama(folder, hf, out: Path):
    """Meta names, use_hf_rope: ExecuTorch's HF RoPE path has no rope scaling, so the reference
    is the same weights in transformers with plain RoPE at the same theta."""
    torch.save(llama_to_meta(hf.state_dict()), out / "model.pth")
    (out / "params.json").write_text(json.dumps(params_for(
        hf.config, norm_eps=hf.config.rms_norm_eps, use_hf_rope=True)))
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(hf.config)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    ref = LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(hf.state_dict())
    return "llama3_2", ref


def write_qwen2(folder, hf, out: Path):
    """Meta names with q/k/v biases, params as ExecuTorch's qwen2_5 configs write them; tied, so
    output.weight is the embedding as its converter writes it."""
    sd = llama_to_meta(hf.state_dict(), QWEN2_TO_META)
    sd["output.weight"] = sd["tok_embeddings.weight"]
    torch.save(sd, out / "model.pth")
    (out / "params.json").write_text(json.dumps(params_for(
        hf.config, norm_eps=hf.config.rms_norm_eps, use_hf_rope=True, attention_qkv_bias=True)))
    return "qwen2_5_0_5b", hf


def write_qwen3(folder, hf, out: Path):
    """ExecuTorch's own convert_weights, and params as its qwen3 configs write them."""
    from executorch.examples.models.qwen3.convert_weights import convert_weights

    convert_weights(str(folder), str(out / "model.pth"))
    cfg = hf.config
    (out / "params.json").write_text(json.dumps(params_for(
        cfg, head_dim=cfg.head_dim, norm_eps=cfg.rms_norm_eps, use_hf_rope=True,
        attention_qkv_bias=False, use_qk_norm=True, qk_norm_before_rope=True)))
    return "qwen3_0_6b", hf


def write_phi3(folder, hf, out: Path):
    """Phi-4-mini as ExecuTorch's phi_4_mini convert_weights writes it (it imports torchtune, so
    its split is repeated here: qkv_proj into q, k, v and gate_up_proj into gate, up, under
    Meta's names), with params as its config writes them: partial rotary and LongRoPE."""
    cfg, sd = hf.config, {}
    q = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    for key, value in hf.state_dict().items():
        if key.endswith("qkv_proj.weight"):
            kv = (value.shape[0] - q) // 2
            parts = zip("qkv", value.split([q, kv, kv]))
            sd.update({key.replace("qkv_proj", f"{x}_proj"): v for x, v in parts})
        elif key.endswith("gate_up_proj.weight"):
            parts = zip(("gate", "up"), value.chunk(2))
            sd.update({key.replace("gate_up_proj", f"{x}_proj"): v for x, v in parts})
        else:
            sd[key] = value
    torch.save(llama_to_meta(sd), out / "model.pth")
    rope = cfg.rope_parameters
    (out / "params.json").write_text(json.dumps(params_for(
        cfg, norm_eps=cfg.rms_norm_eps, use_hf_rope=True, attention_qkv_bias=False,
        partial_rotary_factor=rope["partial_rotary_factor"],
        rope_scaling_short_factor=rope["short_factor"],
        rope_scaling_long_factor=rope["long_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        max_position_embeddings=cfg.max_position_embeddings)))
    from transformers import Phi3ForCausalLM

    cfg = copy.deepcopy(cfg)
    cfg.sliding_window = None  # the tiny model's window of 8: ExecuTorch's phi_4_mini has none
    ref = Phi3ForCausalLM(cfg).eval()
    ref.load_state_dict(hf.state_dict())
    return "phi_4_mini", ref


def write_qwen3_5(folder, hf, out: Path):
    """ExecuTorch's own convert_weights, and params as its qwen3_5 configs write them: the q
    gate, the unit offset of the norms, the DeltaNet sizes, partial rotary."""
    from executorch.examples.models.qwen3_5.convert_weights import convert_weights

    convert_weights(str(folder), str(out / "model.pth"))
    cfg = hf.config
    (out / "params.json").write_text(json.dumps(params_for(
        cfg, head_dim=cfg.head_dim, norm_eps=cfg.rms_norm_eps, use_hf_rope=True,
        partial_rotary_factor=cfg.rope_parameters["partial_rotary_factor"],
        attention_qkv_bias=False, use_qk_norm=True, qk_norm_before_rope=True,
        attention_type="mha", use_q_gate=True, rms_norm_add_unit_offset=True,
        layer_types=cfg.layer_types, **{f: getattr(cfg, f) for f in (
            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads")})))
    return "qwen3_5_0_8b", hf


@pytest.mark.parametrize("arch, write", [("lfm2", write_lfm2), ("llama", write_llama),
                                         ("qwen2", write_qwen2), ("qwen3", write_qwen3),
                                         ("phi3", write_phi3), ("qwen3_5_text", write_qwen3_5)])
def test_executorch_checkpoint_matches_transformers(tiny_models, prompt_ids, tmp_path, arch,
                                                     write):
    folder, hf = tiny_models[arch]
    model_class, ref = write(folder, hf, tmp_path)
    source = load_executorch(tmp_path / "model.pth", tmp_path / "params.json", model_class)
    assert source.hf_config.model_type == arch and source.origin == str(tmp_path / "model.pth")
    assert source.hf_config.tie_word_embeddings == hf.config.tie_word_embeddings
    tokens, expected = reference_run(ref, prompt_ids, steps=4)
    model = build_model(source.hf_config, source.state_dict, ModelOptions(64), torch.float32)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=f"{arch} from ExecuTorch .pth")


def test_meta_layout_matches_executorch_eager_model(tmp_path):
    """Interleaved-RoPE q/k rows (use_hf_rope false) and scaled RoPE, against ExecuTorch's own
    loader (llama/model.py), which also forces rope_scale_factor 32 for llama3_2."""
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model import Llama2Model
    from executorch.examples.models.llama.model_args import ModelArgs
    from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType

    params = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,
                  rope_theta=500000.0, use_scaled_rope=True, use_hf_rope=False)
    torch.manual_seed(0)
    random = construct_transformer(ModelArgs(**params))
    sd = {k: torch.randn_like(v) * 0.2 for k, v in random.state_dict().items()}
    torch.save(sd, tmp_path / "model.pth")
    (tmp_path / "params.json").write_text(json.dumps(params))
    cfg = LlmConfig()
    cfg.base.model_class, cfg.base.params = ModelType.llama3_2, str(tmp_path / "params.json")
    cfg.base.checkpoint = str(tmp_path / "model.pth")
    cfg.export.max_seq_length = cfg.export.max_context_length = 64
    reference = Llama2Model(cfg).get_eager_model().eval()

    source = load_executorch(tmp_path / "model.pth", tmp_path / "params.json", "llama3_2")
    # Positions this short barely turn the scaled frequencies: compare the frequencies too
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    et_freqs = torch.atan2(reference.rope.freqs_sin[1], reference.rope.freqs_cos[1])
    torch.testing.assert_close(LlamaRotaryEmbedding(source.hf_config).inv_freq, et_freqs,
                               rtol=1e-5, atol=0)
    model = build_model(source.hf_config, source.state_dict, ModelOptions(64), torch.float32)
    tokens = torch.tensor([[3, 17, 42, 5, 88, 61, 9, 30, 2, 77, 14]])
    with torch.no_grad():
        expected = reference(tokens).reshape(1, -1)
        actual = model(tokens, torch.tensor([0]))
    assert_logits_close(actual, expected, atol=1e-4, what="Meta layout vs ExecuTorch")


@pytest.mark.parametrize("path", sorted(REFERENCE_PARAMS.glob("*_config.json")),
                         ids=lambda p: p.name)
def test_upstream_lfm2_params_convert(path):
    params = json.loads(path.read_text())
    cfg = hf_config_from_params(params, path.name.removesuffix("_config.json"))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == (
        "lfm2", params["dim"], params["n_layers"])
    assert cfg.layer_types == params["layer_types"][:params["n_layers"]]
    assert cfg.intermediate_size == params["hidden_dim"] and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == params["rope_theta"]


def test_lfm2_5_350m_shape():
    cfg = hf_config_from_params(
        json.loads((REFERENCE_PARAMS / "lfm2_5_350m_config.json").read_text()), "lfm2_5_350m")
    assert (cfg.hidden_size, cfg.num_hidden_layers, len(cfg.layer_types),
            cfg.intermediate_size) == (1024, 16, 16, 4608)


def test_every_modelargs_field_at_its_default_is_accepted():
    """A field ExecuTorch adds is refused as unknown until this source decides what it means."""
    import dataclasses

    from executorch.examples.models.llama.model_args import ModelArgs
    from executorch.extension.llm.export.config.llm_config import ModelType

    base = dict(dim=64, n_layers=2, n_heads=4, vocab_size=96)
    for f in dataclasses.fields(ModelArgs):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        params = {**base, f.name: getattr(default, "value", default)} | base
        assert hf_config_from_params(params, "llama3_2").hidden_size == 64, f.name
    classes = [c for a in every() if a.executorch for c in a.executorch.model_classes]
    assert set(classes) | set(REFUSED_CLASSES) == {t.value for t in ModelType}
    assert len(set(classes)) == len(classes) and not set(classes) & set(REFUSED_CLASSES)


LFM2_PARAMS = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=128,
                   use_hf_rope=True, use_qk_norm=True, qk_norm_before_rope=True,
                   layer_types=["conv", "full_attention"] * 2)


@pytest.mark.parametrize("model_class, match", [
    ("llama3_2_vision", r"model_class 'llama3_2_vision' is not supported: a torchtune "
                        r"multimodal.*Supported: lfm2_350m, .*qwen2_5_0_5b, .*qwen3_5_4b"),
    ("gpt5", r"Unknown ExecuTorch model_class 'gpt5'\..*Supported: lfm2_350m"),
    ("llama3_3", r"Unknown ExecuTorch model_class 'llama3_3'\. Did you mean 'llama3_\d'\?")])
def test_refuses_model_class(model_class, match):
    with pytest.raises(InputError, match=match):
        hf_config_from_params(LFM2_PARAMS, model_class)


@pytest.mark.parametrize("change, match", [
    ({"n_layerz": 4}, r"unknown key 'n_layerz' \(did you mean 'n_layers'\?\): not a field of "
                      r"ExecuTorch's ModelArgs"),
    ({"dim": None}, r"dim=None must be a positive integer"),
    ({"moe": True}, r"moe=True is not supported \(only False\)"),
    ({"act_fn": "gelu"}, r"act_fn='gelu' is not supported \(only 'silu'\)"),
    ({"layer_types": ["conv"] * 3}, r"layer_types has 3 entries for n_layers 4"),
    ({"layer_types": ["conv", "sliding_attention"] * 2},
     r"layer_types holds \['sliding_attention'\]; allowed: conv, full_attention"),
    ({"use_hf_rope": False}, r"use_hf_rope, use_qk_norm and qk_norm_before_rope must all be"),
    ({"partial_rotary_factor": 0.5},
     r"partial_rotary_factor=0\.5 is not supported by lfm2 \(only 1\.0\)"),
], ids=["unknown key", "null dim", "moe", "act_fn", "short layer_types", "odd layer kind",
        "meta rope", "phi's rope elsewhere"])
def test_refuses_params(change, match):
    with pytest.raises(InputError, match=match):
        hf_config_from_params({**LFM2_PARAMS, **change}, "lfm2_350m")


def test_refuses_params_missing_dim_and_names_every_problem():
    params = {k: v for k, v in LFM2_PARAMS.items() if k != "dim"} | {"bogus": 1}
    with pytest.raises(InputError, match=r"missing required key dim; unknown key 'bogus'"):
        hf_config_from_params(params, "lfm2_350m")


def test_refuses_llama_params_lfm2_features():
    params = dict(dim=64, n_layers=2, n_heads=4, vocab_size=96, use_qk_norm=True,
                  use_scaled_rope=True)
    with pytest.raises(InputError, match=r"use_qk_norm=true: Llama has no q/k norms \(Qwen3 "
                       r"has: model_class qwen3_0_6b, qwen3_1_7b or qwen3_4b\); "
                       r"use_scaled_rope=true is refused by ExecuTorch for llama2"):
        hf_config_from_params(params, "llama2")


@pytest.fixture
def pair(tmp_path):
    """A valid lfm2 checkpoint and params JSON (random weights, tied head)."""
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    sd = construct_transformer(ModelArgs(**LFM2_PARAMS)).state_dict()
    sd["output.weight"] = sd["tok_embeddings.weight"]
    torch.save(sd, tmp_path / "model.pth")
    (tmp_path / "params.json").write_text(json.dumps(LFM2_PARAMS))
    return tmp_path / "model.pth", tmp_path / "params.json"


def test_loads_wrapped_state_dict(pair, tmp_path):
    pth, params = pair
    sd = torch.load(pth, weights_only=True)
    torch.save({"model": sd, "epoch": 3}, tmp_path / "wrapped.pth")  # llama/model.py unwraps
    source = load_executorch(tmp_path / "wrapped.pth", params, "lfm2_350m")
    build_model(source.hf_config, source.state_dict, ModelOptions(16), torch.float32)


def test_refuses_truncated_checkpoint(pair):
    pth, params = pair
    pth.write_bytes(pth.read_bytes()[:pth.stat().st_size // 2])
    with pytest.raises(InputError, match=rf"{pth} is not a readable PyTorch checkpoint \(.*\)\. "
                       "It may be truncated"):
        load_executorch(pth, params, "lfm2_350m")


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling would create the marker file
        return pathlib.Path.touch, (self.marker,)


def test_refuses_pickled_objects_without_running_them(pair, tmp_path):
    pth, params = pair
    marker = tmp_path / "ran"
    torch.save({"x": Payload(marker)}, pth)
    with pytest.raises(InputError, match=r"holds pickled objects that are not tensors "
                       r"\(\S+\).*weights_only=True"):
        load_executorch(pth, params, "lfm2_350m")
    assert not marker.exists()


@pytest.mark.parametrize("content, match", [
    ([torch.ones(2)], r"is not a state dict \(it holds a list\)"),
    ({"w": torch.ones(2), "step": 7}, r"is not a state dict \(it holds non-tensor entries "
                                      r"\['step'\]\)")])
def test_refuses_non_state_dicts(pair, content, match):
    pth, params = pair
    torch.save(content, pth)
    with pytest.raises(InputError, match=match):
        load_executorch(pth, params, "lfm2_350m")


def test_refuses_missing_and_unreadable_params(pair, tmp_path):
    pth, _ = pair
    with pytest.raises(InputError, match=r"params file .*nope\.json does not exist"):
        load_executorch(pth, tmp_path / "nope.json", "lfm2_350m")
    (tmp_path / "bad.json").write_text("{dim: 64")
    with pytest.raises(InputError, match=r"bad\.json is not readable JSON"):
        load_executorch(pth, tmp_path / "bad.json", "lfm2_350m")


def test_refuses_untied_lfm2(pair):
    pth, params = pair
    sd = torch.load(pth, weights_only=True)
    sd["output.weight"] = torch.randn_like(sd["tok_embeddings.weight"])
    torch.save(sd, pth)
    with pytest.raises(InputError, match=r"output\.weight differs from tok_embeddings\.weight"):
        load_executorch(pth, params, "lfm2_350m")


def test_leftover_tensors_reach_the_loader(pair):
    pth, params = pair
    sd = torch.load(pth, weights_only=True)
    del sd["layers.0.conv.C_proj.weight"]
    sd["layers.1.attention.wz.weight"] = torch.zeros(2)
    torch.save(sd, pth)
    source = load_executorch(pth, params, "lfm2_350m")
    with pytest.raises(InputError, match=r"missing tensors: model\.layers\.0\.conv\.b_proj.*; "
                       r"unexpected tensors: layers\.0\.conv\.B_proj\.weight, "
                       r"layers\.0\.conv\.x_proj\.weight, layers\.1\.attention\.wz\.weight"):
        build_model(source.hf_config, source.state_dict, ModelOptions(16), torch.float32)


def test_qwen3_params_need_its_head_norms():
    params = {**LFM2_PARAMS, "layer_types": None, "head_dim": 32}
    assert hf_config_from_params(params, "qwen3_0_6b").model_type == "qwen3"
    with pytest.raises(InputError, match=r"use_hf_rope, use_qk_norm and qk_norm_before_rope must "
                       r"all be true, as in ExecuTorch's qwen3 configs"):
        hf_config_from_params({**params, "use_qk_norm": False}, "qwen3_0_6b")


QWEN3_5_PARAMS = {**LFM2_PARAMS, "head_dim": 16, "use_q_gate": True,
                  "rms_norm_add_unit_offset": True, "partial_rotary_factor": 0.25,
                  "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
                  "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4}


def test_qwen3_5_params_need_the_gate_the_offset_and_the_deltanet_sizes():
    cfg = hf_config_from_params(QWEN3_5_PARAMS, "qwen3_5_2b")
    assert (cfg.model_type, cfg.linear_num_value_heads, cfg.layer_types[3]) == (
        "qwen3_5_text", 4, "full_attention")
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    derived = {k: v for k, v in QWEN3_5_PARAMS.items() if k != "linear_value_head_dim"}
    assert hf_config_from_params(derived, "qwen3_5_2b").linear_value_head_dim == 16  # head_dim
    with pytest.raises(InputError, match=r"use_hf_rope, use_qk_norm, qk_norm_before_rope, "
                       r"use_q_gate and rms_norm_add_unit_offset must all be true, as in "
                       r"ExecuTorch's qwen3_5 configs"):
        hf_config_from_params({**QWEN3_5_PARAMS, "use_q_gate": False}, "qwen3_5_2b")
    with pytest.raises(InputError, match=r"use_q_gate=True is not supported by lfm2 \(only "
                       r"False\); linear_num_key_heads=2 is not supported by lfm2"):
        hf_config_from_params({**LFM2_PARAMS, "use_q_gate": True, "linear_num_key_heads": 2},
                              "lfm2_350m")


def test_qkv_biases_belong_to_qwen2_only():
    params = {**LFM2_PARAMS, "layer_types": None}
    with pytest.raises(InputError, match=r"attention_qkv_bias=true: llama has no q/k/v biases "
                       r"\(qwen2 has: model_class qwen2_5_0_5b or qwen2_5_1_5b or "):
        hf_config_from_params({**params, "use_qk_norm": False, "attention_qkv_bias": True},
                              "llama3_2")
    with pytest.raises(InputError, match=r"use_hf_rope and attention_qkv_bias must be true and "
                       r"use_qk_norm false, as in ExecuTorch's qwen2_5 configs"):
        hf_config_from_params({**params, "use_qk_norm": False}, "qwen2_5_0_5b")
