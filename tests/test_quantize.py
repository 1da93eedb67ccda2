"""Quantization recipes on a tiny model: the program runs, its report holds what the recipe costs
against the float model, within the recipe's stated bounds; impossible combinations refused."""

import pytest

import edgellm
from edgellm.quantize import ACCURACY_BOUNDS


@pytest.mark.parametrize("recipe, group", [("8da4w", 32), ("8da4w", 0), ("8da8w", None)])
def test_recipe_runs_and_reports_its_accuracy(tiny_models, tmp_path, recipe, group):
    folder = tiny_models["lfm2"][0]
    fp32 = edgellm.export(folder, output=tmp_path / "f", backends="xnnpack", max_seq_len=16,
                          max_context_len=32, verify=False, quiet=True)
    report = edgellm.export(folder, output=tmp_path / "q", backends="xnnpack", max_seq_len=16,
                            max_context_len=32, quantize=recipe, group_size=group, quiet=True)
    checks = {c["level"]: c for c in report["verify"]["checks"]}
    assert list(checks) == ["rewrite", "program", "quantization"] and report["verify"]["passed"]
    cost = checks["quantization"]
    assert (cost["min_sqnr_db"], cost["min_top1"]) == ACCURACY_BOUNDS[recipe]
    assert cost["sqnr_db"] >= ACCURACY_BOUNDS[recipe][0] and cost["top1"] >= 0.6
    assert cost["sqnr_db"] < checks["program"]["sqnr_db"]  # quantization is the larger error
    bits = 4 if recipe == "8da4w" else 8
    assert report["weight_bytes_per_token"] < fp32["weight_bytes_per_token"] * (bits + 8) / 32
    assert [s["name"] for s in report["stages"]].count("quantize") == 1


def test_8da8w_with_groups_is_refused(tiny_models, tmp_path):
    with pytest.raises(edgellm.ConfigError, match=r"group_size: 32 with 8da8w; XNNPACK "
                       r"quantizes 8-bit weights per channel only"):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / "q", quantize="8da8w",
                       group_size=32, quiet=True)
    assert not (tmp_path / "q").exists()
