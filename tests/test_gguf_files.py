"""GGUF files as llama.cpp itself writes them: tests/data/gguf holds tiny random models of every
family edgellm reads from GGUF, quantized by llama.cpp's own quantizer (bench/gguf_fixtures.py
wrote them; manifest.json says with which llama.cpp and what each file holds). Llama comes in
every file type users download, the other families in Q4_K_M, whose 320-wide down projections
take llama.cpp's fallbacks (Q5_0, Q8_0) beside its K-quants. Each file reads as transformers
runs the same dequantized weights; a choice of them exports in its own quantization and
verifies, and a float export generates transformers' greedy tokens."""

import json
from pathlib import Path

import pytest
import torch

import edgellm
from edgellm.sources import load_source
from test_sources import LLAMACPP_ARCH

FIXTURES = Path(__file__).parent / "data" / "gguf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FILES = sorted(MANIFEST["files"])
LLAMACPP_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M",
                  "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
EXPORTED = ("llama-Q4_K_M.gguf", "llama-Q8_0.gguf", "llama-IQ4_XS.gguf", "llama-F16.gguf",
            "gemma3_text-Q4_K_M.gguf", "qwen3_moe-Q4_K_M.gguf")


def test_the_files_hold_what_llamacpp_writes_for_real_models():
    """Every file type of the issue for Llama, Q4_K_M for every other family that reads GGUF,
    and llama.cpp's fallbacks for rows that are not a multiple of 256 (Q5_0, Q5_1, Q8_0,
    IQ4_NL) beside the K-quants: what the manifest says is what gguf reads in each file."""
    import gguf

    from edgellm.architectures.registry import every

    files = MANIFEST["files"]
    assert {f["type"] for f in files.values() if f["family"] == "llama"} == set(LLAMACPP_TYPES)
    readable = {a.gguf.arch for a in every() if a.gguf is not None}
    assert {LLAMACPP_ARCH.get(f["family"], f["family"]) for f in files.values()} == readable
    for fallback, kquant in (("Q5_0", "Q4_K_M"), ("Q5_1", "Q5_K_M"), ("Q8_0", "Q6_K"),
                             ("IQ4_NL", "IQ4_XS")):
        assert fallback in files[f"llama-{kquant}.gguf"]["tensors"], kquant
    for name, info in files.items():
        read = {}
        for t in gguf.GGUFReader(FIXTURES / name).tensors:
            read[t.tensor_type.name] = read.get(t.tensor_type.name, 0) + 1
        assert read == info["tensors"], name


# the least SQNR (dB) of a weight read back against the float weight llama.cpp quantized, per
# file type: each a couple of dB under what the fixtures measure; a misread block, row order or
# scale falls to about 0
LEAST_SQNR = {"Q2_K": 9, "Q3_K_M": 14, "Q4_0": 19, "Q4_1": 20, "Q4_K_S": 20, "Q4_K_M": 20,
              "IQ4_NL": 20, "IQ4_XS": 20, "Q5_0": 25, "Q5_1": 26, "Q5_K_M": 26, "Q6_K": 32,
              "Q8_0": 42, "BF16": 50, "F16": 70}


@pytest.mark.parametrize("name", FILES)
def test_a_llamacpp_file_reads_as_transformers_runs_it(name, prompt_ids):
    """Every weight read from the file is the float weight llama.cpp quantized (the fixture's
    model, rebuilt from its seed), within what the file type loses, under the same Hugging Face
    name; each keeps the storage type the file gives it; and edgellm's eager model and
    transformers' own on those weights give the same logits and greedy tokens over a prompt,
    then one token per call."""
    from conftest import assert_logits_close, cached_run, random_model, reference_run
    from edgellm.architectures import build_model, load_deferred
    from edgellm.architectures.layers import ModelOptions
    from edgellm.numerics import compare
    from edgellm.verification import transformers_model
    from test_sources import fixture_config

    source = load_source(str(FIXTURES / name))
    kinds = set(source.stored_types.values())
    assert kinds <= set(MANIFEST["files"][name]["tensors"]) and kinds - {"F32"}, kinds
    info = MANIFEST["files"][name]
    original = random_model(fixture_config(info["family"], source.hf_config.vocab_size))
    weights = original.state_dict()
    for key, read in source.state_dict.items():
        if isinstance(read, torch.Tensor) and read.dim() >= 2:  # experts: read when asked
            sqnr = compare(read.float(), weights[key].float()).sqnr_db
            assert sqnr >= LEAST_SQNR[info["type"]], (key, sqnr)
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    load_deferred(model)
    tokens, expected = reference_run(transformers_model(source), prompt_ids, steps=6)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=name)


@pytest.mark.parametrize("name", EXPORTED)
def test_a_llamacpp_file_exports_in_its_own_quantization_and_verifies(name, tmp_path):
    """Exported as a user would (no options), a quantized file keeps its quantization (its 4-bit
    types at 4 bits, grids kept where they are 4-bit blocks of 32, its 6- and 8-bit ones at 8)
    and a float file its dtype; the program is the eager model it was exported from (rewrite
    and program checks: what the recipe costs against fp32 is measured on real weights, in
    BENCHMARKS.md), and the report says what each of the file's types became. Qwen3-MoE's
    experts run as a delegate apiece behind a torch.cond, its table quantized around them
    (`fusion.branch_delegates`)."""
    from conftest import SIZES

    from edgellm.errors import VerificationError

    try:
        edgellm.export(FIXTURES / name, output=tmp_path / "out", backends="xnnpack", quiet=True,
                       **SIZES)
    except VerificationError:  # read below: what a recipe costs on random weights is no gate
        pass
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    checks = {c["level"]: c["passed"] for c in report["verify"]["checks"]}
    assert checks["rewrite"] and checks["program"], report["verify"]
    kind = MANIFEST["files"][name]["type"]
    if kind in ("F16", "BF16"):
        assert report["dtype"] == {"F16": "fp16", "BF16": "bf16"}[kind]
        assert "quantization" not in report
        return
    if name.startswith("qwen3_moe"):
        assert (report["quantization"]["experts"], report["quantization"]["embeddings"]) == \
            ("chosen", "4,32")
    became = report["quantization"]["from_source"]
    assert set(became) <= set(MANIFEST["files"][name]["tensors"])
    for kept in ("Q4_0", "Q4_1", "Q4_K"):
        assert set(became.get(kept, {})) <= {"4-bit, the file's grid kept", "table float",
                                             "table 4-bit, the file's grid kept"}, became
    for spared in ("Q6_K", "Q8_0"):
        assert all(to.startswith(("8-bit", "table")) for to in became.get(spared, {})), became
    md = (tmp_path / "out" / "report.md").read_text()
    for kind, tos in became.items():
        for to, e in tos.items():
            db = "unchanged" if e["weight_sqnr_db"] is None else e["weight_sqnr_db"]
            assert f"| {kind} | {to} | {e['tensors']} | {db} |" in md, (kind, to)
    # what each choice cost the file's weights: its 4-bit codes kept lose only their blocks'
    # offsets to 8 bits; a grid the file did not choose loses more
    cost = {to: e["weight_sqnr_db"] for tos in became.values() for to, e in tos.items()}
    if "4-bit, the file's grid kept" in cost:
        assert cost["4-bit, the file's grid kept"] > max(
            [40] + [cost[to] for to in cost if to.startswith(("4-bit on", "table 4-bit in"))]), cost
    regridded = {"4-bit on Q4_1's grid", "table 4-bit in groups of 32"}
    for low in ("Q5_0", "Q5_1", "Q5_K", "Q2_K", "Q3_K"):  # on Q4_1's grid
        assert set(became.get(low, {})) <= regridded, became
    for ungridded in ("IQ4_NL", "IQ4_XS"):  # 16 levels no 4-bit grid holds: 8 bits
        assert all(to.startswith(("8-bit", "table 8-bit")) for to in became.get(ungridded, {})
                   ), became
    if name == "llama-Q4_K_M.gguf":  # its one Q5_0 linear (a row no multiple of 256)
        assert list(became["Q5_0"]) == ["4-bit on Q4_1's grid"], became
        assert became["Q5_0"]["4-bit on Q4_1's grid"]["tensors"] == 1


def test_a_float_export_of_a_llamacpp_file_generates_transformers_tokens(tmp_path):
    """--dtype fp32 asks for the float program: its greedy continuation of a prompt is
    transformers' on the file's dequantized weights."""
    from tokenizers import Tokenizer

    from conftest import PROMPT, SIZES
    from edgellm.architectures import build_model, load_deferred
    from edgellm.architectures.layers import ModelOptions
    from edgellm.program import Program, greedy
    from edgellm.verification import transformers_model

    name = "llama-Q4_K_M.gguf"
    report = edgellm.export(FIXTURES / name, output=tmp_path / "out", backends="xnnpack",
                            quiet=True, dtype="fp32", **SIZES)
    assert report["verify"]["passed"] and "quantization" not in report
    ids = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode(PROMPT).ids[:8]
    source = load_source(str(FIXTURES / name))
    load_deferred(build_model(source.hf_config, source.state_dict, ModelOptions(32),
                              torch.float32))
    with torch.no_grad():
        expected = transformers_model(source).generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    program = Program(tmp_path / "out" / "model.pte")
    assert list(greedy(program.forward, program.prefill, ids, 8, set())) == expected


@pytest.mark.parametrize("name, backend, overrides, expected", [
    ("llama-Q4_K_M.gguf", "xnnpack", [], ("fp32", "8da4w", 32, "4,32")),
    ("llama-Q4_K_M.gguf", "coreml", [], ("fp32", "4w", 32, "4,32")),
    ("llama-Q4_K_M.gguf", "coreml", ["coreml.min_ios=17"], ("fp32", "8w", 0, "8")),
    ("llama-Q6_K.gguf", "xnnpack", [], ("fp32", "8da8w", 0, "8")),
    ("llama-Q8_0.gguf", "coreml", [], ("fp32", "8w", 0, "8")),
    ("llama-IQ4_XS.gguf", "xnnpack", [], ("fp32", "8da8w", 0, "8")),
    ("llama-F16.gguf", "xnnpack", [], ("fp16", None, None, None)),
    ("llama-BF16.gguf", "coreml", [], ("bf16", None, None, None)),
    ("llama-Q4_0.gguf", "vulkan", [], ("fp32", None, None, None)),
    ("qwen3_moe-Q4_K_M.gguf", "xnnpack", [], ("fp32", "8da4w", 32, "4,32")),
])
def test_the_file_s_storage_picks_the_default_recipe(name, backend, overrides, expected):
    """With no dtype or recipe given, the file's storage types choose: mostly 4-bit linears the
    backend's 4-bit recipe at the file's block of 32, 6- or 8-bit ones its 8-bit recipe, the
    table 4 bits beside 4-bit linears and 8 beside 8-bit ones, F16 / BF16 their dtype; the 8-bit
    recipe and table where the backend's options refuse 4 bits (Core ML before iOS 18), and
    for IQ4 files (16 levels on no uniform grid: a 4-bit grid of them loses too much); no
    recipe on a backend with none. Any of dtype, quantize or embedding_quantize given turns it off."""
    from edgellm.config import resolve_config

    cfg = resolve_config(FIXTURES / name, backends=backend, overrides=overrides)
    assert (cfg.dtype, cfg.quantize, cfg.group_size, cfg.embedding_quantize) == expected
    assert resolve_config(FIXTURES / name, backends=backend, dtype="fp32").quantize is None
