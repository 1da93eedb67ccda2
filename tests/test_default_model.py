"""The embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF), exported to XNNPACK in its own
quantization and verified against transformers running the same dequantized weights;
ExecuTorch's own runner on it."""

import pytest

import edgellm

pytestmark = pytest.mark.heavy  # a real-size model: first, so that it runs beside the rest


def test_the_default_program_keeps_the_file_s_quantization_and_is_verified(default_export):
    """With no options, the embedded Q4_1 GGUF exports in its own quantization: every Q4_1 linear
    keeps the file's 4-bit codes (its minima 8-bit), the Q8_0 head keeps 8 bits and the table
    (stored twice, as XNNPACK writes the head apart) takes 4. The export's own verification ran
    transformers on the same dequantized weights: the eager model is transformers' (top-1 1.0),
    the program is the eager quantized model, and along 64 tokens of the shipped text its
    perplexity stays within 15% of transformers' in fp32 (a window this short moves by several
    percent; the file requantized onto new symmetric grids lands near 30%: BENCHMARKS.md); then
    the program completes a prompt on its own."""
    folder, report = default_export
    assert report["model"]["model_type"] == "llama" and report["model"]["n_layers"] == 30
    became = report["quantization"]["from_source"]
    assert {kind: {to: e["tensors"] for to, e in tos.items()} for kind, tos in became.items()} \
        == {"Q4_1": {"4-bit, the file's grid kept": 210},
            "Q8_0": {"8-bit per channel": 1, "table 4-bit in groups of 32": 1}}
    # what each choice cost the weights: the file's codes are kept and its minima take 8 bits
    # per channel; its 8-bit table requantized to 4 loses most
    cost = {to: e["weight_sqnr_db"] for tos in became.values() for to, e in tos.items()}
    assert cost["table 4-bit in groups of 32"] < 25 < cost["8-bit per channel"] \
        < cost["4-bit, the file's grid kept"], cost
    result = report["verify"]
    assert result["passed"] and [c["level"] for c in result["checks"]] == [
        "rewrite", "program", "quantization"]
    assert result["checks"][0]["top1"] == 1.0
    ppl = result["perplexity"]
    assert ppl["tokens"] == 64 and ppl["program"] < 1.15 * ppl["transformers_fp32"], ppl
    pieces = []
    text = edgellm.generate(folder / "model.pte", "The capital of France is", n=24,
                            on_text=pieces.append)
    assert "Paris" in text
    assert "".join(pieces) == text and len(pieces) > 3  # streamed a few tokens' text at a time


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


def test_the_demo_asks_through_the_chat_template_and_stops_at_the_end_of_the_turn(default_export):
    """`bash run.sh` asks the instruct model run.sh's question as a user message in the GGUF's
    chat template: the reply answers it and ends at the model's end of turn, before the token
    budget, with no end-of-turn marker in the text."""
    import re
    import shlex
    from pathlib import Path

    from edgellm.run.sampling import Sampling
    from edgellm.run.session import Session

    demo = next(line for line in (Path(__file__).parents[1] / "run.sh").read_text().splitlines()
                if "edgellm generate" in line)
    args = shlex.split(demo)
    assert "--chat" in args
    question, budget = args[args.index("--prompt") + 1], int(args[args.index("-n") + 1])
    folder, _ = default_export
    session = Session(folder / "model.pte")
    run = session.generate(session.chat_ids([{"role": "user", "content": question}]),
                           Sampling.of(max_tokens=budget))
    text = "".join(run)
    assert re.search(r"\bParis\b", text), text
    assert run.finish_reason == "stop" and "<|im_end|>" not in text, (run.finish_reason, text)
