"""Every backend through the same lowering call: Core ML, chains, Vulkan (built here, not run);
the chain rules and the recipe rules read from each backend's data."""

import pytest

import edgellm
from edgellm.backends import BACKENDS, check_chain


def test_coreml_takes_the_whole_lfm2(exported):
    folder, report = exported("lfm2", backends="coreml")
    d = report["methods"]["forward"]["delegation"]
    assert d["subgraphs"] == 1
    assert d["non_delegated_compute_nodes"] == 0, d["by_op"]
    assert report["deprecation_warnings"] == 0, report["deprecation_messages"]
    assert report["dynamic_shapes"] is False
    assert list(d["by_backend"]) == ["CoreMLBackend"]
    sdpa = [o for p in report["preserved_ops"] for o in p["ops"]
            if o["op"] == "aten.scaled_dot_product_attention.default"]
    assert sdpa and sdpa[0]["status"] == "intact" and sdpa[0]["in_program"] == 2
    assert report["files"]["etrecord"] == "etrecord.bin"
    assert (folder / "etrecord.bin").stat().st_size > 0
    assert set(report["patches"]) >= {"coreml.shared_weights", "exir.composite_fake_runs"}
    assert set(report["patches"].values()) == {"on"}


def test_chain_reports_both_backends_and_where_ops_went(exported):
    _, report = exported("lfm2", backends="coreml,xnnpack", verify=False, etrecord=False)
    assert report["backends"] == ["coreml", "xnnpack"]
    assert [p["partitioner"] for p in report["preserved_ops"]] == ["CoreMLPartitioner",
                                                                   "XnnpackPartitioner"]
    d = report["methods"]["forward"]["delegation"]
    placed = sum(n for b in d["by_backend"].values() for n in b["ops"].values())
    assert placed == d["delegated_nodes"] > 0
    assert sum(b["subgraphs"] for b in d["by_backend"].values()) == d["subgraphs"]


def test_vulkan_builds_a_program_with_its_etrecord(exported):
    folder, report = exported("llama", backends="vulkan", verify=False)
    d = report["methods"]["forward"]["delegation"]
    assert list(d["by_backend"]) == ["VulkanBackend"] and d["delegated_nodes"] > 0
    assert (folder / "model.pte").stat().st_size == report["pte_bytes"]
    assert (folder / "etrecord.bin").stat().st_size > 0


@pytest.mark.parametrize("chain,message", [
    ("portable,xnnpack", "'portable' means no delegate and cannot be chained"),
    ("xnnpack,xnnpack", "xnnpack listed more than once"),
    ("xnnpack,coreml", "coreml after xnnpack in xnnpack,coreml would only see what XNNPACK "
                       "leaves, ExecuTorch's llama:: custom ops it cannot run; XNNPACK is the CPU "
                       "fallback, and goes last \\(e.g. coreml,xnnpack\\)"),
    ("tpu", "unknown backend.*'tpu'.*supported: xnnpack, coreml, vulkan, portable"),
])
def test_chains_that_make_no_sense_are_refused(tiny_models, tmp_path, chain, message):
    with pytest.raises(edgellm.ConfigError, match=message):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / "x", backends=chain, quiet=True)
    assert not (tmp_path / "x").exists()


def test_the_chain_rules_are_the_backends_data(monkeypatch):
    """A backend that must go last, or cannot be chained, says so in its data; check_chain
    names no backend."""
    import dataclasses

    monkeypatch.setitem(BACKENDS, "vulkan", dataclasses.replace(
        BACKENDS["vulkan"], goes_last="Vulkan leaves"))
    assert check_chain(["vulkan", "coreml"]) == [
        "backends: coreml after vulkan in vulkan,coreml would only see what Vulkan leaves, and "
        "goes last (e.g. coreml,vulkan)"]
    monkeypatch.setitem(BACKENDS, "coreml", dataclasses.replace(BACKENDS["coreml"],
                                                                delegates=False))
    assert any("'coreml' means no delegate" in p for p in check_chain(["coreml", "xnnpack"]))


def test_which_recipes_a_backend_takes_is_its_data(monkeypatch):
    """The recipe rules read Backend.recipes and .refuses: give Vulkan 8da4w and it is
    accepted; make Core ML refuse 4w and it is refused with Core ML's reason."""
    import dataclasses

    from edgellm.config import from_dict

    with pytest.raises(edgellm.ConfigError, match="8da4w on vulkan: vulkan has no kernels"):
        from_dict({"backends": "vulkan", "quantize": "8da4w"})
    monkeypatch.setitem(BACKENDS, "vulkan", dataclasses.replace(BACKENDS["vulkan"],
                                                                recipes=("8da4w",)))
    assert from_dict({"backends": "vulkan", "quantize": "8da4w"}).quantize == "8da4w"
    monkeypatch.setitem(BACKENDS, "coreml", dataclasses.replace(
        BACKENDS["coreml"], refuses={"4w": "not today"}))
    with pytest.raises(edgellm.ConfigError, match=r"quantize: 4w on coreml: not today\. "
                       r"Recipes per backend: xnnpack: 8da4w, 8da8w; coreml: 4w, 8w; "
                       r"vulkan: 8da4w"):
        from_dict({"backends": "coreml", "quantize": "4w"})


def test_no_module_outside_backends_compares_a_backends_name():
    """Backend facts are data on Backend: the rest of the package reads them, and names no
    backend in a comparison (a default value, a docstring or an error message may)."""
    import re
    from pathlib import Path

    package = Path(edgellm.__file__).parent
    names = "|".join(BACKENDS) + "|mlx"
    quoted = rf"""["']({names})["']"""
    compared = re.compile(rf"(==|!=|\bin\b)\s*\(?{quoted}|{quoted}\s*(==|!=|\bin\b)")
    found = [f"{p.relative_to(package)}:{i}: {line.strip()}"
             for p in package.rglob("*.py") if p.parent.name != "backends"
             for i, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert found == []
