"""Core ML programs that are right by construction: where state lives, what the payload holds,
and the formulation's fp16 safety. Core ML cannot run on Linux; its payload (an mlpackage) can be
read, and that is what these tests inspect."""

import dataclasses

import pytest
import torch

import edgellm
from edgellm.backends import BACKENDS


def buffers(arch: str, folder) -> dict:
    """{buffer name as Core ML spells it: shape} for every mutable buffer of the tiny model."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    out = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_types[i] if arch == "lfm2" else "full_attention"
        if kind == "conv":
            out[f"model_layers_{i}_conv_conv_state"] = [1, cfg.conv_L_cache - 1, cfg.hidden_size]
        else:
            attn = "self_attn_cache"
            hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            for name in ("k_cache", "v_cache"):
                out[f"model_layers_{i}_{attn}_{name}"] = [1, cfg.num_key_value_heads, 32, hd]
    return out


@pytest.mark.parametrize("arch", ["lfm2", "qwen3"])  # conv states; heads of their own width
@pytest.mark.parametrize("state", ["io", "coreml"])
def test_state_lands_where_the_policy_says(tiny_models, exported, arch, state):
    folder = tiny_models[arch][0]
    if state == "io":  # the default
        report = exported(arch, backends="coreml")[1]
    else:
        report = exported(arch, backends="coreml", verify=False, etrecord=False,
                          overrides=[f"coreml.state={state}"])[1]
    [delegate] = report["delegates"]["coreml"]
    expected = buffers(arch, folder)
    inputs = {f["name"]: f["shape"] for f in delegate["inputs"]}
    states = {f["name"]: f["shape"] for f in delegate["states"]}
    if state == "io":
        assert states == {}
        assert {n: inputs[f"b_{n}"] for n in expected} == expected
        # every buffer comes back as an output besides the logits
        assert len(delegate["outputs"]) == len(expected) + 1
    else:
        assert states == expected
        assert set(inputs) == {"tokens", "input_pos"}
        assert [f["name"] for f in delegate["outputs"]] and len(delegate["outputs"]) == 1
        assert all(f["dtype"] == "float16" for f in delegate["states"])
    assert delegate["mil_ops"] == sum(delegate["mil_histogram"].values()) > 0
    assert "const" not in delegate["mil_histogram"]


def test_lint_catches_a_delegate_that_disagrees_with_the_policy(tiny_models, tmp_path,
                                                                 monkeypatch):
    """Force the mismatch: the partitioner takes state over while the policy says io."""
    from edgellm.backends import coreml

    def wrong_partitioners(options):
        return coreml._partitioners(dataclasses.replace(options, state="coreml"))

    monkeypatch.setitem(BACKENDS, "coreml", dataclasses.replace(
        BACKENDS["coreml"], make_partitioners=wrong_partitioners))
    with pytest.raises(edgellm.VerificationError, match=r"disagrees with state policy 'io': "
                       r"model\.layers\.0\.conv\.conv_state became a Core ML state.*"
                       r"model\.layers\.1\.self_attn\.cache\.k_cache became a Core ML state"):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / "c", backends="coreml",
                       max_seq_len=16, quiet=True)
    assert not (tmp_path / "c").exists()
    assert not list(tmp_path.glob(".c.partial-*"))


def test_settings_reach_the_compile_specs_and_sdpa_is_fused_only_from_ios18(tiny_models,
                                                                              exported, tmp_path):
    folder = tiny_models["llama"][0]
    old = edgellm.export(folder, output=tmp_path / "a", backends="coreml", max_seq_len=16,
                         quiet=True, verify=False, overrides=[
                             "coreml.min_ios=17", "coreml.precision=fp32",
                             "coreml.compute_units=cpu_only"])
    [d17] = old["delegates"]["coreml"]
    assert (d17["min_deployment_target"], d17["precision"], d17["compute_units"]) == (
        "iOS17", "float32", "cpu_only")
    assert "scaled_dot_product_attention" not in d17["mil_histogram"]
    assert d17["mil_histogram"]["softmax"] == 2  # one per layer, decomposed
    [d18] = exported("llama", backends="coreml")[1]["delegates"]["coreml"]
    assert (d18["min_deployment_target"], d18["precision"], d18["compute_units"]) == (
        "iOS18", "float16", "cpu_and_ne")
    assert d18["mil_histogram"]["scaled_dot_product_attention"] == 2
    assert "softmax" not in d18["mil_histogram"]


@pytest.mark.parametrize("arch, norms", [("lfm2", 11), ("qwen3", 7)])
def test_every_norm_reaches_core_ml_with_its_fp16_guard(exported, arch, norms):
    """LFM2 tiny: 4 layers x 2 norms + 2 attention layers x 1 (q and k heads normalized
    together, layers.fused_qk) + the final norm = 11; Qwen3 tiny: 2 layers x (2 + 1, its q and
    k heads fused the same way) + the final norm = 7. Each is one ATen node, guarded in MIL."""
    report = exported(arch, backends="coreml")[1]
    [delegate] = report["delegates"]["coreml"]
    ops = report["methods"]["forward"]["delegation"]["by_backend"]["CoreMLBackend"]["ops"]
    assert ops["aten.rms_norm.default"] == norms
    assert delegate["mil_histogram"]["reduce_max"] == norms  # the max|x| rescale of each norm
    assert "rsqrt" not in delegate["mil_histogram"]  # no unguarded norm anywhere


def test_naive_rms_norm_overflows_in_fp16_and_the_guarded_one_does_not():
    """Why Core ML gets `aten.rms_norm` (which coremltools expands with a max|x| rescale) and not
    x * rsqrt(mean(x*x)): Core ML runs fp16, where x*x overflows once |x| > 256. Residual streams
    of real models reach that. Both spellings evaluated op by op in fp16."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, 64) * 4
    x[..., 3] = 300.0  # one outlier channel, as LLM residual streams have
    eps = 1e-5
    exact = x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + eps)
    h = x.half()
    naive = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    # coremltools 9.0 `rms_norm`: abs, reduce_max, real_div, square, reduce_mean, add, sqrt, mul,
    # real_div, all in fp16
    peak = h.abs().amax(-1, keepdim=True)
    rms = torch.sqrt(((h / peak) ** 2).mean(-1, keepdim=True) + eps) * peak
    guarded = h / rms
    assert not torch.isfinite((h * h)).all()
    assert naive.abs().max() == 0  # rsqrt(inf) wipes the whole row out
    assert torch.allclose(guarded.double(), exact, rtol=5e-3, atol=5e-3)


def test_state_coreml_below_ios18_is_refused_before_any_work(tiny_models, tmp_path):
    with pytest.raises(edgellm.ConfigError, match=r"state: 'coreml' needs min_ios 18 or later"):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / "c", backends="coreml",
                       overrides=["coreml.state=coreml", "coreml.min_ios=17"], quiet=True)
    assert not (tmp_path / "c").exists()


def test_prefill_and_forward_share_one_multifunction_payload(exported):
    """Both methods lower into one Core ML model with a function each (weights stored once),
    and both pass the lint: their caches stay ExecuTorch buffers that the methods share."""
    report = exported("llama", backends="coreml", prefill_chunk=4, verify=False,
                      etrecord=False)[1]
    by_method = {d["method"]: d for d in report["delegates"]["coreml"]}
    assert set(by_method) == {"forward", "prefill"}
    assert by_method["forward"]["functions"] == ["forward", "prefill"]
    tokens = {m: next(f["shape"] for f in d["inputs"] if f["name"] == "tokens")
              for m, d in by_method.items()}
    assert tokens == {"forward": [1, 1], "prefill": [1, 4]}
    assert all(d["states"] == [] for d in by_method.values())
    single = exported("llama", backends="coreml")[1]
    assert report["pte_bytes"] < 1.5 * single["pte_bytes"]  # not a second copy of the weights


@pytest.mark.parametrize("prefill_chunk", [0, 4])
def test_the_spec_read_through_the_payload_index_describes_as_unpacking_does(
        exported, monkeypatch, prefill_chunk):
    """Inspect reads each payload's model.mlmodel where the payload's index says it lies, instead
    of unpacking the whole mlpackage (weights included) into a folder; a payload without an index
    is still unpacked. Both give the same description, one method or two sharing a payload."""
    from edgellm.backends import coreml_payload

    options = dict(prefill_chunk=4, verify=False, etrecord=False) if prefill_chunk else {}
    pte = exported("llama", backends="coreml", **options)[0] / "model.pte"
    read = coreml_payload.describe_payloads(pte)
    with open(pte, "rb") as f:  # the index is there: nothing was unpacked
        assert read and all(coreml_payload._mlmodel_files(f, r[-1])
                            for r in coreml_payload._regions(pte))
    monkeypatch.setattr(coreml_payload, "_mlmodel_files", lambda f, payload: [])
    assert coreml_payload.describe_payloads(pte) == read
