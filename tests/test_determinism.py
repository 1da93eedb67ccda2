"""The same inputs and options give a byte-identical model.pte (XNNPACK, float and quantized).
Core ML is the exception, by ExecuTorch's design: each payload carries a fresh uuid4 identifier,
which the device's compiled-model cache keys on (docs/design.md)."""

import pytest

import edgellm


@pytest.mark.parametrize("options", [{}, {"quantize": "8da4w", "group_size": 32,
                                          "embedding_quantize": "4,32"}])
def test_exporting_twice_gives_the_same_bytes(tiny_models, tmp_path, options):
    paths = []
    for name in ("a", "b"):
        edgellm.export(tiny_models["lfm2"][0], output=tmp_path / name, backends="xnnpack",
                       max_seq_len=16, verify=False, quiet=True, **options)
        paths.append(tmp_path / name / "model.pte")
    first, second = (p.read_bytes() for p in paths)
    assert len(first) > 10_000 and first == second
