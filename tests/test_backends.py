"""Every backend through the same lowering call: Core ML, chains, Vulkan (built here, not run)."""

import pytest

import edgellm


@pytest.fixture(scope="module")
def lfm2(tiny_models):
    return tiny_models["lfm2"][0]


def test_coreml_takes_the_whole_lfm2(lfm2, tmp_path):
    report = edgellm.export(lfm2, output=tmp_path / "c", backends="coreml", max_seq_len=16,
                            quiet=True)
    d = report["methods"]["forward"]["delegation"]
    assert d["subgraphs"] == 1
    assert d["non_delegated_compute_nodes"] == 0, d["by_op"]
    assert report["deprecation_warnings"] == 0, report["deprecation_messages"]
    assert report["dynamic_shapes"] is False
    assert list(d["by_backend"]) == ["CoreMLBackend"]
    sdpa = [o for p in report["preserved_ops"] for o in p["ops"]
            if o["op"] == "aten.scaled_dot_product_attention.default"]
    assert sdpa and sdpa[0]["status"] == "intact" and sdpa[0]["in_program"] == 2


def test_chain_reports_both_backends_and_where_ops_went(lfm2, tmp_path):
    report = edgellm.export(lfm2, output=tmp_path / "cx", backends="coreml,xnnpack",
                            max_seq_len=16, quiet=True)
    assert report["backends"] == ["coreml", "xnnpack"]
    assert [p["partitioner"] for p in report["preserved_ops"]] == ["CoreMLPartitioner",
                                                                   "XnnpackPartitioner"]
    d = report["methods"]["forward"]["delegation"]
    placed = sum(n for b in d["by_backend"].values() for n in b["ops"].values())
    assert placed == d["delegated_nodes"] > 0
    assert sum(b["subgraphs"] for b in d["by_backend"].values()) == d["subgraphs"]


def test_vulkan_builds_an_lfm2_program(lfm2, tmp_path):
    report = edgellm.export(lfm2, output=tmp_path / "v", backends="vulkan", max_seq_len=16,
                            quiet=True)
    d = report["methods"]["forward"]["delegation"]
    assert list(d["by_backend"]) == ["VulkanBackend"] and d["delegated_nodes"] > 0
    assert (tmp_path / "v" / "model.pte").stat().st_size == report["pte_bytes"]


@pytest.mark.parametrize("chain,message", [
    ("portable,xnnpack", "'portable' means no delegate and cannot be chained"),
    ("xnnpack,xnnpack", "xnnpack listed more than once"),
    ("tpu", "unknown backend.*'tpu'.*supported: xnnpack, coreml, vulkan, portable"),
])
def test_chains_that_make_no_sense_are_refused(lfm2, tmp_path, chain, message):
    with pytest.raises(edgellm.ConfigError, match=message):
        edgellm.export(lfm2, output=tmp_path / "x", backends=chain, quiet=True)
    assert not (tmp_path / "x").exists()
