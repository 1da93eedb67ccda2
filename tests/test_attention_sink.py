"""Attention sinks (`--attention-sink SINK,WINDOW`): full-attention caches keep the first SINK
positions and a ring of the last WINDOW, and the program goes on past max_context_len.

The reference is StreamingLLM itself: with one layer, a step's logits are those of transformers
run on the tokens the cache holds (the sinks, then the window) at positions 0, 1, ... within it,
because a key's RoPE enters attention only through its distance to the query and the window's
keys sit at their true distances. (With more layers the window's keys were computed when more of
the text was in reach, which a recomputation cannot reproduce.)"""

import re

import pytest
import torch

import edgellm
from conftest import make_tokenizer, save_model, tiny_llama_config
from edgellm.architectures import build_model
from edgellm.architectures.layers import ModelOptions
from edgellm.cli import main
from edgellm.numerics import compare

SINK, WINDOW = 2, 6
SIZES = dict(max_seq_len=4, max_context_len=16, attention_sink=(SINK, WINDOW))
STEPS = 57  # one-token calls after a 3-token prompt: to position 59, far past the context (16)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer tiny Llama (Llama 3 RoPE scaling, untied) and its transformers model."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sink") / "llama1"
    cfg = tiny_llama_config(make_tokenizer(folder))
    cfg.num_hidden_layers = 1
    save_model(cfg, folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return [int(x) for x in torch.randint(2, 160, (3 + STEPS,), generator=g)]


@pytest.fixture(scope="module")
def streaming_llm(one_layer, ids):
    """transformers' logits at each step on what the cache holds: sinks, then the window."""
    hf, rows = one_layer[1], []
    with torch.no_grad():
        for p in range(3, len(ids)):
            held = ids[:SINK] + ids[max(SINK, p - WINDOW + 1):p + 1]
            rows.append(hf(torch.tensor([held])).logits[0, -1])
    return torch.stack(rows)


def decode(forward, ids):
    """A 3-token prompt, then one token per call; the logits after each of those calls."""
    forward(torch.tensor([ids[:3]]), torch.tensor([0]))
    return torch.stack([forward(torch.tensor([[ids[p]]]), torch.tensor([p]))[0]
                        for p in range(3, len(ids))])


@pytest.mark.parametrize("attention", ["custom_ops", "sdpa"])
def test_eager_model_is_streaming_llm_far_past_the_context(one_layer, ids, streaming_llm,
                                                           attention):
    """Both ways a backend writes attention (XNNPACK's custom ops; Core ML's, Vulkan's and
    portable's index_put and SDPA), 57 steps past a window of 6 behind 2 sinks."""
    from edgellm.sources import load_source

    source = load_source(str(one_layer[0]))
    opts = ModelOptions(max_context_len=16, max_call_len=4, attention=attention,
                        attention_sink=(SINK, WINDOW))
    model = build_model(source.hf_config, source.state_dict, opts, torch.float32)
    with torch.no_grad():
        c = compare(decode(model, ids), streaming_llm)
    assert c.sqnr_db > 100 and c.argmax_agree == 1.0, c


def test_int8_sink_cache_is_the_float_one_within_its_bounds(one_layer, ids, streaming_llm):
    """An int8 cache with sinks: the rotated sink keys are quantized as they are written into
    the sink slots, the ring's as they arrive; within the int8 cache's bounds of StreamingLLM."""
    from edgellm.sources import load_source

    source = load_source(str(one_layer[0]))
    opts = ModelOptions(max_context_len=16, max_call_len=4, attention="custom_ops",
                        attention_sink=(SINK, WINDOW), kv_cache="int8")
    model = build_model(source.hf_config, source.state_dict, opts, torch.float32)
    with torch.no_grad():
        c = compare(decode(model, ids), streaming_llm)
    assert 30 < c.sqnr_db < 90 and c.argmax_agree >= 0.9, c


@pytest.fixture(scope="module")
def sink_program(one_layer, tmp_path_factory):
    out = tmp_path_factory.mktemp("sink") / "xnnpack"
    report = edgellm.export(one_layer[0], output=out, quiet=True, **SIZES)
    return out, report


def test_program_is_streaming_llm_far_past_the_context(sink_program, ids, streaming_llm):
    """The XNNPACK program through ExecuTorch's runtime, positions to 59 in a context of 16;
    its report gives each layer's sink and ring slots."""
    from edgellm.program import Program

    folder, report = sink_program
    program = Program(folder / "model.pte")
    assert program.sink == [SINK, WINDOW]
    c = compare(decode(program.forward, ids), streaming_llm)
    assert c.sqnr_db > 100 and c.argmax_agree == 1.0, c
    [layer] = report["state"]["layers"]
    assert layer["window"] == WINDOW and layer["sink_k"] == [1, SINK, 2, 16]
    assert layer["k_cache"] == [1, SINK + WINDOW + 4 - 1, 2, 16]  # a call of 4 evicts nothing
    assert report["verify"]["passed"]  # checked within the positions before the first eviction


def test_program_generates_ten_thousand_tokens_in_flat_memory(sink_program):
    from edgellm.memory import rss_mb
    from edgellm.program import Program, greedy, native_logs

    program, resident = Program(sink_program[0] / "model.pte"), {}
    with native_logs():
        for i, _ in enumerate(greedy(program.forward, program.prefill, [3, 4, 5], 10_000, set())):
            if i in (1_000, 9_999):
                resident[i] = rss_mb()
    assert i == 9_999 and resident[9_999] - resident[1_000] < 1.0, resident


def test_executorch_runner_goes_on_past_the_context(sink_program):
    """ExecuTorch's TextLLMRunner passes ever-growing positions and, for a program whose
    max_seq_len is below its max_context_len, lets one generate call follow another without
    reset: four calls of up to 15 tokens (fewer where one stops at EOS) go past twice the
    context of 16, where a program without sinks fails the second call."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    folder = sink_program[0]
    runner, pieces = TextLLMRunner(str(folder / "model.pte"), str(folder)), []
    for _ in range(4):
        runner.generate("the quick brown", GenerationConfig(
            max_new_tokens=15, temperature=0.0, echo=False, warming=False),
            token_callback=pieces.append)
    assert len(pieces) > 2 * 16


def test_bench_measures_far_past_the_context(sink_program, capsys):
    """Depth 100 in a context of 16: the cache read is the sinks and the ring, not the depth."""
    folder, report = sink_program
    assert main(["bench", str(folder), "--prompt-lengths", "4", "--steps", "4", "--repeats", "1",
                 "--depth", "0,100"]) == 0
    r = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    [layer] = report["kv_cache"]["layers"]
    assert r["by_depth"]["100"]["cache_bytes_read"] == layer["bytes"]
    assert r["decode_tok_s_by_depth"]["100"] > 0


def test_generate_goes_on_past_the_context(sink_program, monkeypatch):
    """A session asks a sink program for every token requested, positions past the context
    included (a program without sinks gets at most max_context_len minus the prompt); the
    tokens' positions run on from the prompt's."""
    from edgellm.program import Program
    from edgellm.run.sampling import Sampling
    from edgellm.run.session import Session

    seen, real = [], Program.forward
    monkeypatch.setattr(Program, "forward", lambda self, tokens, input_pos: seen.append(
        int(input_pos[0])) or real(self, tokens, input_pos))
    session = Session(sink_program[0] / "model.pte")
    session.eos = set()  # run every step
    ids = session.encode("the quick")
    run = session.generate(ids, Sampling(max_tokens=40))
    run.run()
    assert session.context is None and len(run.tokens) == 40 and run.finish_reason == "length"
    assert seen[-39:] == list(range(len(ids), len(ids) + 39))  # past twice the context (16)


@pytest.mark.parametrize("options, problem", [
    (dict(max_seq_len=4, attention_sink=(2, 6)),
     "attention_sink: needs max_context_len above max_seq_len (4): ExecuTorch's runner goes on "
     "past max_context_len only for a program whose max_seq_len is the smaller, and takes at "
     "most max_context_len tokens per generate call; e.g. max_context_len 12"),
    (dict(max_seq_len=4, max_context_len=16, attention_sink=(2, 0)),
     "attention_sink: 2,0 is not SINK,WINDOW with SINK >= 0 and WINDOW >= 1 (e.g. 4,1020)"),
    (dict(max_seq_len=4, max_context_len=16, attention_sink=(2, 6), backends="coreml",
          prefill_chunk=4),
     "attention_sink with prefill_chunk on coreml: its prefill method writes a ring of "
     "fixed-length calls, which has no sink slots yet; drop prefill_chunk (a prompt then goes a "
     "token per call) or export for xnnpack")])
def test_what_a_sink_program_cannot_be_is_refused(tiny_models, tmp_path, options, problem):
    with pytest.raises(edgellm.ConfigError) as e:
        edgellm.export(tiny_models["llama"][0], output=tmp_path / "o", **options)
    assert e.value.problems == [problem]


def test_the_flag_takes_sink_and_window(tiny_models, tmp_path, capsys):
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"),
                 "--attention-sink", "2", "--max-context-len", "8"]) == 2
    assert re.search(r"attention_sink: 2 is not SINK,WINDOW", capsys.readouterr().err)
