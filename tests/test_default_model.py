"""The embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF), exported to XNNPACK, against
transformers running the same dequantized weights."""

import pytest

import edgellm
from conftest import reference_run


@pytest.fixture(scope="module")
def default_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "smollm2"
    report = edgellm.export(output=out, backends="xnnpack", max_seq_len=64, quiet=True)
    return out, report


def test_default_greedy_tokens_match_transformers(default_export):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    from edgellm.runtime import Program, greedy
    from edgellm.sources import load_source

    folder, report = default_export
    assert report["model"]["model_type"] == "llama" and report["model"]["n_layers"] == 30
    source = load_source(None)
    hf = LlamaForCausalLM(source.hf_config).eval()
    missing, unexpected = hf.load_state_dict(source.state_dict, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    hf.tie_weights()
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        "The capital of France is").ids
    expected, _ = reference_run(hf, ids, steps=8)
    program = Program(folder / "model.pte")
    actual = list(greedy(program.forward, program.prefill, ids, 8, eos=set()))
    assert actual == expected
    text = edgellm.generate(folder / "model.pte", "The capital of France is", n=8)
    assert "Paris" in text


def test_text_llm_runner_runs_the_program_unchanged(default_export):
    """ExecuTorch's own LLM runner, with the tokenizer.json converted from the GGUF, produces
    the same greedy text as edgellm's runtime."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    folder, _ = default_export
    prompt = "The capital of France is"
    ours = edgellm.generate(folder / "model.pte", prompt, n=8)
    pieces = []
    runner = TextLLMRunner(str(folder / "model.pte"), str(folder))
    # max_new_tokens counts the token prefill produces; warming keeps its stats off stdout
    runner.generate(prompt, GenerationConfig(max_new_tokens=8, temperature=0.0, echo=False,
                                             warming=True), token_callback=pieces.append)
    assert "".join(pieces).replace("<|im_end|>", "") == ours
