"""Quantization recipes on tiny models: the program runs (XNNPACK) or lowers (Core ML) with
quantized weights, its report holds what the recipe costs against the float model (SQNR, top-1,
perplexity along the shipped text), within the recipe's stated bounds; impossible combinations are
refused before any work."""

import dataclasses

import pytest

import edgellm
from edgellm.config import ExportConfig
from edgellm.quantize import accuracy_bounds

SIZES = dict(max_seq_len=16, max_context_len=32)


def cost_of(report):
    checks = {c["level"]: c for c in report["verify"]["checks"]}
    return checks, checks["quantization"]


@pytest.mark.parametrize("recipe, group, embedding", [
    ("8da4w", 32, None), ("8da4w", 0, None), ("8da8w", None, None), ("8da4w", 32, "4,32"),
    (None, None, "8")])
def test_xnnpack_recipe_runs_and_reports_its_accuracy(tiny_models, tmp_path, recipe, group,
                                                      embedding):
    folder = tiny_models["lfm2"][0]
    fp32 = edgellm.export(folder, output=tmp_path / "f", backends="xnnpack", verify=False,
                          quiet=True, **SIZES)
    report = edgellm.export(folder, output=tmp_path / "q", backends="xnnpack", quantize=recipe,
                            group_size=group, embedding_quantize=embedding, quiet=True, **SIZES)
    checks, cost = cost_of(report)
    assert list(checks) == ["rewrite", "program", "quantization"] and report["verify"]["passed"]
    bounds = accuracy_bounds(ExportConfig(quantize=recipe, embedding_quantize=embedding))
    assert (cost["min_sqnr_db"], cost["min_top1"]) == bounds
    assert cost["sqnr_db"] >= bounds[0] and cost["top1"] >= bounds[1]
    assert cost["sqnr_db"] < checks["program"]["sqnr_db"]  # quantization is the larger error
    ppl = report["verify"]["perplexity"]
    assert ppl["tokens"] == 32 and 1 < ppl["program"] < 2 * ppl["transformers_fp32"]
    assert 0.5 <= ppl["top1_vs_fp32"] <= 1
    if recipe:
        bits = 4 if recipe == "8da4w" else 8
        assert report["weight_bytes_per_token"] < fp32["weight_bytes_per_token"] * (bits + 8) / 32
    if embedding:  # the table (vocab x 64, fp32) is stored in 8 or 4 bits, plus scales
        table = 4 * 64 * tiny_models["lfm2"][1].vocab_size
        saved = fp32["pte_bytes"] - report["pte_bytes"]
        assert saved > table * (0.7 if embedding == "8" else 0.8)
        kernel = b"embedding_byte" if embedding == "8" else b"embedding_4bit"
        assert kernel in (tmp_path / "q" / "model.pte").read_bytes()  # the operator table
    assert [s["name"] for s in report["stages"]].count("quantize") == 1
    md = (tmp_path / "q" / "report.md").read_text()
    assert "quantization: ok" in md and "perplexity:" in md


@pytest.mark.parametrize("recipe, group, min_ios, constexpr", [
    ("4w", None, 18, "constexpr_blockwise_shift_scale"),
    ("4w", 0, 18, "constexpr_blockwise_shift_scale"),
    ("8w", None, 17, "constexpr_affine_dequantize")])
def test_coreml_recipe_lowers_with_quantized_weights(tiny_models, tmp_path, recipe, group,
                                                     min_ios, constexpr):
    report = edgellm.export(tiny_models["llama"][0], output=tmp_path / "c", backends="coreml",
                            quantize=recipe, group_size=group, quiet=True,
                            overrides=[f"coreml.min_ios={min_ios}"], **SIZES)
    [delegate] = report["delegates"]["coreml"]
    linears = delegate["mil_histogram"]["linear"]
    assert delegate["mil_histogram"][constexpr] == linears  # every linear reads stored ints
    checks, cost = cost_of(report)
    assert list(checks) == ["rewrite", "exported graph", "quantization"]
    assert report["verify"]["passed"] and "exported graph" in cost["note"]
    assert report["verify"]["perplexity"]["exported_graph"] > 1


@pytest.mark.parametrize("kwargs, overrides, match", [
    (dict(backends="xnnpack", quantize="4w"), [],
     r"quantize: 4w on xnnpack: ExecuTorch 1\.5\.1's XNNPACK delegate takes torchao weight-only "
     r"linears but multiplies by the unscaled integers.*use 8da4w on xnnpack"),
    (dict(backends="coreml,xnnpack", quantize="8w"), [],
     r"quantize: 8w on xnnpack \(in the chain\): ExecuTorch 1\.5\.1's XNNPACK delegate"),
    (dict(backends="coreml", quantize="8da4w"), [],
     r"quantize: 8da4w on coreml: coreml has no kernels for it\. Recipes per backend: "
     r"xnnpack: 8da4w, 8da8w; coreml: 4w, 8w"),
    (dict(backends="coreml", quantize="4w"), ["coreml.min_ios=17"],
     r"quantize: 4w with group_size 32 needs coreml.min_ios 18 \(4-bit and block-wise weights "
     r"arrive in iOS 18\), not 17"),
    (dict(backends="coreml", quantize="8w", group_size=64), ["coreml.min_ios=17"],
     r"quantize: 8w with group_size 64 needs coreml\.min_ios 18"),
    (dict(backends="coreml", embedding_quantize="4,32"), ["coreml.min_ios=17"],
     r"embedding_quantize: '4,32' needs coreml\.min_ios 18"),
    (dict(backends="vulkan", embedding_quantize="8"), [],
     r"embedding_quantize: vulkan has no quantized embedding kernels"),
    (dict(embedding_quantize="3"), [],
     r"embedding_quantize: '3' is not BITS\[,GROUP\] with BITS 8 or 4"),
    (dict(quantize="8da8w", group_size=32), [],
     r"group_size: 32 with 8da8w; XNNPACK quantizes 8-bit weights per channel only"),
    (dict(group_size=32), [], r"group_size: 32 is set but quantize is not"),
    (dict(quantize="int3"), [], r"quantize: 'int3' is not one of 8da4w, 8da8w, 4w, 8w"),
])
def test_impossible_recipes_are_refused_before_any_work(tiny_models, tmp_path, kwargs, overrides,
                                                        match):
    with pytest.raises(edgellm.ConfigError, match=match):
        edgellm.export(tiny_models["llama"][0], output=tmp_path / "q", quiet=True,
                       overrides=overrides, **kwargs)
    assert not (tmp_path / "q").exists()


def test_bounds_of_a_combined_recipe_are_the_looser_ones_loosened():
    both = ExportConfig(quantize="8da8w", embedding_quantize="4,32")
    assert accuracy_bounds(both) == (12.0, 0.65)
    assert accuracy_bounds(dataclasses.replace(both, embedding_quantize=None)) == (20.0, 0.8)


def test_linears_a_group_does_not_divide_are_reported_and_named(tiny_models, tmp_path, capsys):
    """The tiny Llama's hidden size is 64: with group 128 only down_proj (input 128) is 4-bit,
    as in export_llm; the export says so instead of shipping a mostly-float program quietly."""
    report = edgellm.export(tiny_models["llama"][0], output=tmp_path / "q", backends="xnnpack",
                            quantize="8da4w", group_size=128, verify=False, **SIZES)
    q = report["quantization"]
    assert q["recipe"] == "8da4w" and q["group_size"] == 128 and q["embeddings"] is None
    assert q["linears_quantized"] == 2 and "bytes_saved" not in q
    assert len(q["linears_left_float"]) == 13 and "lm_head" in q["linears_left_float"]
    err = capsys.readouterr().err
    assert ("[edgellm] quantize: 13 of 15 linears stay in float: their input width is no multiple "
            "of group_size 128 (model.layers.0.self_attn.q_proj") in err
