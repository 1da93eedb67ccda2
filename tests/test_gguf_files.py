"""GGUF files as llama.cpp itself writes them: tests/data/gguf holds tiny random models of every
family edgellm reads from GGUF, quantized by llama.cpp's own quantizer (bench/gguf_fixtures.py
wrote them; manifest.json says with which llama.cpp and what each file holds). Llama comes in
every file type users download, the other families in Q4_K_M, whose 320-wide down projections
take llama.cpp's fallbacks (Q5_0, Q8_0) beside its K-quants. Each file reads as transformers
runs the same dequantized weights; a choice of them exports, verifies and generates
transformers' greedy tokens."""

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
EXPORTED = ("llama-Q4_K_M.gguf", "llama-IQ4_XS.gguf", "llama-BF16.gguf",
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


@pytest.mark.parametrize("name", FILES)
def test_a_llamacpp_file_reads_as_transformers_runs_it(name, prompt_ids):
    """The file's weights, dequantized by gguf, in edgellm's eager model and in transformers'
    own: a prompt, then one token per call, the same logits and greedy tokens; each weight keeps
    the storage type the file gives it."""
    from conftest import assert_logits_close, cached_run, reference_run
    from edgellm.architectures import build_model, load_deferred
    from edgellm.architectures.layers import ModelOptions
    from edgellm.verification import transformers_model

    source = load_source(str(FIXTURES / name))
    kinds = set(source.stored_types.values())
    assert kinds <= set(MANIFEST["files"][name]["tensors"]) and kinds - {"F32"}, kinds
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    load_deferred(model)
    tokens, expected = reference_run(transformers_model(source), prompt_ids, steps=6)
    with torch.no_grad():
        actual = cached_run(model, prompt_ids, tokens)
    assert_logits_close(actual, expected, atol=1e-4, what=name)


@pytest.mark.parametrize("name", EXPORTED)
def test_a_llamacpp_file_exports_verifies_and_generates_transformers_tokens(name, tmp_path):
    """Exported to XNNPACK as a user would (no options), the program passes its verification and
    its greedy continuation of a prompt is transformers' on the file's dequantized weights."""
    from tokenizers import Tokenizer

    from conftest import PROMPT, SIZES
    from edgellm.architectures import build_model, load_deferred
    from edgellm.architectures.layers import ModelOptions
    from edgellm.runtime import Program, greedy
    from edgellm.verification import transformers_model

    report = edgellm.export(FIXTURES / name, output=tmp_path / "out", backends="xnnpack",
                            quiet=True, **SIZES)
    assert report["verify"]["passed"], report["verify"]
    ids = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).encode(PROMPT).ids[:8]
    source = load_source(str(FIXTURES / name))
    load_deferred(build_model(source.hf_config, source.state_dict, ModelOptions(32),
                              torch.float32))
    with torch.no_grad():
        expected = transformers_model(source).generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    program = Program(tmp_path / "out" / "model.pte")
    assert list(greedy(program.forward, program.prefill, ids, 8, set())) == expected
