"""ExecuTorch `export_llm` configs run unchanged: the seed's command shape on a tiny checkpoint,
every field honoured or refused by name."""

import json
from pathlib import Path

import pytest

import edgellm
from edgellm.cli import main
from edgellm.etconfig import translate

CONFIGS = Path(__file__).parent / "data" / "executorch-lfm2-params"


@pytest.fixture(scope="module")
def lfm2_pth(tiny_models, tmp_path_factory):
    """The tiny LFM2 as ExecuTorch's own converter writes it, with a params JSON of its shape."""
    from executorch.examples.models.lfm2.convert_weights import convert_weights

    folder, hf = tiny_models["lfm2"]
    out = tmp_path_factory.mktemp("pth")
    convert_weights(str(folder), str(out / "model.pth"))
    cfg = hf.config
    (out / "params.json").write_text(json.dumps(dict(
        dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
        hidden_dim=cfg.intermediate_size, ffn_dim_multiplier=1, norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_parameters["rope_theta"], use_scaled_rope=False, use_hf_rope=True,
        use_qk_norm=True, qk_norm_before_rope=True, layer_types=list(cfg.layer_types))))
    return out, folder, hf


def seed_command(config: str, pth, out: Path) -> list[str]:
    """ExecuTorch's test plan for the seed, with a tiny checkpoint and short sequences."""
    return ["export", "--config", str(CONFIGS / config), "+base.model_class=lfm2_350m",
            f"+base.params={pth / 'params.json'}", f"+base.checkpoint={pth / 'model.pth'}",
            "+export.max_seq_length=16", "+export.max_context_length=16",
            f"+export.output_name={out}.pte", "--quiet"]


def test_coreml_config_runs_unchanged(lfm2_pth, tmp_path, capsys):
    pth, _, _ = lfm2_pth
    assert main(seed_command("lfm2_coreml_fp32.yaml", pth, tmp_path / "lfm2_coreml")) == 0
    report = json.loads((tmp_path / "lfm2_coreml" / "report.json").read_text())
    assert report["backends"] == ["coreml"] and report["max_seq_len"] == 16
    [delegate] = report["delegates"]["coreml"]
    # enable_state: True -> Core ML states; ios 18 and preserve_sdpa -> fused attention
    assert len(delegate["states"]) == 6 and delegate["min_deployment_target"] == "iOS18"
    assert delegate["compute_units"] == "cpu_and_ne"
    assert delegate["mil_histogram"]["scaled_dot_product_attention"] == 2
    assert (tmp_path / "lfm2_coreml" / "model.pte").stat().st_size == report["pte_bytes"]


def test_xnnpack_config_runs_unchanged_and_the_program_runs(lfm2_pth, prompt_ids, tmp_path):
    """The seed's q8da4w config (qmode 8da4w, group 128: on the 64-wide tiny model only the
    feed-forward's down projections are 4-bit) through `.pth` + params, the program close to
    transformers; its fp32 twin differs only in the quantization section (next test)."""
    from conftest import cached_run, reference_run
    from edgellm.numerics import compare
    from edgellm.program import Program

    pth, _, hf = lfm2_pth
    assert main(seed_command("lfm2_xnnpack_q8da4w.yaml", pth, tmp_path / "x")) == 0
    report = json.loads((tmp_path / "x" / "report.json").read_text())
    assert report["backends"] == ["xnnpack"] and report["verify"]["passed"]
    program = Program(tmp_path / "x" / "model.pte")
    assert program.meta["get_bos_id"] == 1 and program.meta["get_eos_ids"] == [7]  # base.metadata
    tokens, expected = reference_run(hf, prompt_ids, steps=4)
    c = compare(cached_run(program.forward, prompt_ids, tokens), expected)
    assert [s["name"] for s in report["stages"]].count("quantize") == 1
    assert c.sqnr_db > 15 and c.argmax_agree >= 0.75, c  # 4-bit weights: close, not equal


def test_the_fp32_xnnpack_config_resolves_to_the_default_recipe(lfm2_pth, tmp_path):
    from edgellm.config import resolve_config

    pth, _, _ = lfm2_pth
    overrides = [a for a in seed_command("lfm2_xnnpack_fp32.yaml", pth, tmp_path / "x")
                 if a.startswith("+")]
    cfg = resolve_config(config=CONFIGS / "lfm2_xnnpack_fp32.yaml", overrides=overrides)
    assert (cfg.backends, cfg.quantize, cfg.dtype, cfg.max_seq_len, cfg.model_class) == (
        ("xnnpack",), None, "fp32", 16, "lfm2_350m")
    assert (cfg.bos_id, cfg.eos_ids, cfg.output) == (1, (7,), str(tmp_path / "x"))


def test_mlx_config_says_why_it_cannot_run(lfm2_pth, tmp_path, capsys):
    pth, _, _ = lfm2_pth
    assert main(seed_command("lfm2_mlx_4w.yaml", pth, tmp_path / "m")) == 2
    err = capsys.readouterr().err
    assert "backend.mlx: MLX cannot be used: its lowering is not available in the Linux " \
           "ExecuTorch wheel" in err
    assert "Traceback" not in err and not (tmp_path / "m").exists()


def test_hf_folder_as_checkpoint_is_checked_against_params(lfm2_pth, tmp_path):
    pth, folder, _ = lfm2_pth
    params = json.loads((pth / "params.json").read_text())
    params["dim"] = 128
    (tmp_path / "wrong.json").write_text(json.dumps(params))
    with pytest.raises(edgellm.InputError, match=r"describe different models: hidden_size 128 "
                       r"vs 64"):
        edgellm.export(config=str(CONFIGS / "lfm2_xnnpack_fp32.yaml"), quiet=True, overrides=[
            "base.model_class=lfm2_350m", f"base.params={tmp_path / 'wrong.json'}",
            f"base.checkpoint={folder}", f"export.output_name={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


BASE = {"backend": {"coreml": {"enabled": True, "ios": 18}},
        "model": {"enable_dynamic_shape": False}}


@pytest.mark.parametrize("change, match", [
    ({"model": {"use_shared_embedding": True}},
     r"model\.use_shared_embedding: True is not supported; edgellm does not support it yet"),
    ({"model": {"use_kv_cache": False}}, r"always keep a KV cache"),
    ({"model": {"enable_dynamic_shape": True}},
     r"enable_dynamic_shape: true, but coreml programs take one token per call"),
    ({"backend": {"coreml": {"enabled": True, "ios": 17, "preserve_sdpa": True}}},
     r"preserve_sdpa: true needs ios 18 or later"),
    ({"backend": {"coreml": {"enabled": True, "ios": 18, "preserve_sdpa": False}}},
     r"preserve_sdpa: false is not supported with ios 18.*Set ios: 17"),
    ({"backend": {"coreml": {"enabled": True, "quantize": "c2w"}}},
     r"backend\.coreml\.quantize: 'c2w' is not supported"),
    ({"quantization": {"qmode": "8da4w"}, "backend": {"coreml": {"enabled": True,
                                                                 "quantize": "b4w"}}},
     r"backend\.coreml\.quantize: asks for 4w with group_size 32, but another field already "
     r"chose 8da4w"),
    ({"quantization": {"qmode": "torchao:8da4w"}},
     r"qmode: 'torchao:8da4w' needs torchao's own CPU kernel library"),
    ({"quantization": {"embedding_quantize": "torchao:4,32"}},
     r"embedding_quantize: 'torchao:4,32' needs torchao's own CPU kernel library"),
    ({"quantization": {"pt2e_quantize": "coreml_8a_c8w"}},
     r"pt2e_quantize: 'coreml_8a_c8w' is not supported; edgellm quantizes weights through "
     r"torchao.*static activation quantization needs calibration data"),
    ({"backend": {"qnn": {"enabled": True}}}, r"backend\.qnn: edgellm has no qnn backend\. "
                                              r"Supported: xnnpack, coreml, vulkan"),
    ({"export": {"max_seq_lenght": 64}}, r"export\.max_seq_lenght: unknown field, not one of "
                                        r"ExecuTorch's LlmConfig\. Did you mean "
                                        r"export\.max_seq_length\?"),
    ({"backend": {"coreml": {"enabled": True, "iso": 17}}},
     r"backend\.coreml\.iso: unknown field.*Did you mean backend\.coreml\.ios\?"),
    ({"backend": {"corml": {"enabled": True}}}, r"backend\.corml: edgellm has no corml backend\. "
                                                r"Did you mean coreml\?"),
    ({"exprot": {"max_seq_length": 64}}, r"exprot: unknown section of an ExecuTorch export_llm "
                                         r"config\. Did you mean export\?"),
    ({"backend": {"coreml": True}}, r"backend\.coreml: expected a mapping of fields"),
    ({"base": {"metadata": "{not json"}}, r"base\.metadata: not valid JSON"),
    ({"base": {"metadata": '{"get_max_seq_len": 9}'}},
     r"base\.metadata: key 'get_max_seq_len' is not supported"),
])
def test_fields_edgellm_cannot_honour_are_refused_by_name(change, match):
    data = {**BASE, **change}
    with pytest.raises(edgellm.ConfigError, match=match):
        translate(data)


@pytest.mark.parametrize("data, expected", [
    ({"quantization": {"pt2e_quantize": "xnnpack_dynamic"}},
     {"quantize": "8da8w", "group_size": 0}),
    ({"quantization": {"pt2e_quantize": "xnnpack_dynamic_qc4"}},
     {"quantize": "8da4w", "group_size": 0}),
    ({"quantization": {"qmode": "8da4w", "group_size": 32, "embedding_quantize": "4,32"}},
     {"quantize": "8da4w", "group_size": 32, "embedding_quantize": "4,32"}),
    ({"quantization": {"qmode": "int8"}}, {"quantize": "8w"}),
    ({"model": {"quantize_kv_cache": True}}, {"kv_cache": "int8"}),
    ({"model": {"quantize_kv_cache": False}}, {}),
    ({"model": {"use_attention_sink": "4,2044"}}, {"attention_sink": "4,2044"}),
    ({"backend": {"coreml": {"enabled": True, "quantize": "b4w"}}},
     {"quantize": "4w", "group_size": 32, "backends": ["coreml"]}),
    ({"backend": {"coreml": {"enabled": True, "quantize": "c4w"}}},
     {"quantize": "4w", "group_size": 0, "backends": ["coreml"]}),
])
def test_quantization_fields_map_onto_recipes(data, expected):
    assert translate(data) == expected


def test_every_problem_is_reported_at_once():
    with pytest.raises(edgellm.ConfigError) as e:
        translate({"model": {"use_kv_cache": False, "use_shared_embedding": True},
                   "backend": {"vulkan": {"enabled": True, "force_fp16": True}}})
    assert len(e.value.problems) == 3, e.value.problems


def test_fields_map_onto_settings_that_take_effect():
    out = translate({"base": {"metadata": '{"get_bos_id": 1, "get_eos_ids": [7]}'},
                     "model": {"dtype_override": "fp16", "use_kv_cache": True},
                     "export": {"max_seq_length": 64, "output_dir": "exports",
                                "output_name": "m.pte"},
                     "backend": {"coreml": {"enabled": True, "ios": 17, "enable_state": False,
                                            "compute_units": "cpu_only"}},
                     "debug": {"generate_etrecord": True}})
    assert out == {"bos_id": 1, "eos_ids": [7], "dtype": "fp16", "max_seq_len": 64,
                   "backends": ["coreml"], "output": str(Path("exports") / "m"),
                   "coreml": {"min_ios": 17, "state": "io", "compute_units": "cpu_only"},
                   "etrecord": True}


def test_executorch_qwen3_config_resolves_to_its_recipe(tiny_models, tmp_path):
    """ExecuTorch's own qwen3_xnnpack_q8da4w.yaml (8da4w, 8-bit embeddings, base.metadata) with
    the tiny Qwen3 as its qwen3 converter writes it; group 32 because the tiny model is 64 wide.
    The checkpoint is read as the export would read it (the program of a Qwen3 .pth: the parity
    tests of test_sources_executorch.py, of a quantized XNNPACK program: test_quantize.py)."""
    import executorch.examples.models.qwen3 as qwen3
    from executorch.examples.models.qwen3.convert_weights import convert_weights

    from edgellm.config import resolve_config
    from edgellm.sources import load_source

    folder, hf = tiny_models["qwen3"]
    convert_weights(str(folder), str(tmp_path / "model.pth"))
    cfg = hf.config
    (tmp_path / "params.json").write_text(json.dumps(dict(
        dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps, use_hf_rope=True,
        rope_theta=cfg.rope_parameters["rope_theta"], use_qk_norm=True,
        qk_norm_before_rope=True)))
    yaml = Path(qwen3.__file__).parent / "config" / "qwen3_xnnpack_q8da4w.yaml"
    resolved = resolve_config(config=yaml, overrides=[
        "+base.model_class=qwen3_0_6b", f"+base.params={tmp_path / 'params.json'}",
        f"+base.checkpoint={tmp_path / 'model.pth'}", "++export.max_seq_length=16",
        "++export.max_context_length=32", "+quantization.group_size=32",
        f"+export.output_name={tmp_path / 'q'}.pte"])
    assert (resolved.quantize, resolved.group_size, resolved.embedding_quantize) == (
        "8da4w", 32, "8,0")
    assert (resolved.backends, resolved.bos_id, resolved.eos_ids) == (("xnnpack",), 151644,
                                                                      (151645,))
    source = load_source(resolved.model, params=resolved.params,
                         model_class=resolved.model_class)
    assert source.hf_config.model_type == "qwen3" and source.hf_config.head_dim == 32
