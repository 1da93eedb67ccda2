"""Qwen3.5: a gated DeltaNet layer beside a gated full-attention layer (conftest's tiny
`qwen3_5_text`, two value heads per key head). The families' ladder (test_families.py) checks the
eager model in every backend's formulation and the exported graph; here the XNNPACK program takes
prompts of 1, 7 and 29 tokens in one call, through ExecuTorch's llama::gated_delta_rule, then a
token per call; Core ML takes both methods whole with the recurrence written out; the state's
buffers, the .pth's and a multimodal folder's loading, and a 4-bit recipe."""

import pytest
import torch

from conftest import assert_logits_close
from edgellm.architectures import build_model
from edgellm.architectures.cache import state_report
from edgellm.architectures.layers import ModelOptions

SIZES = dict(max_seq_len=32, max_context_len=48, verify=False, etrecord=False)
XNNPACK = dict(SIZES, prefill_chunk=8)  # and a `prefill` method of 8 tokens beside `forward`
CONV, HEADS, DK, DV = 64, 4, 8, 8  # conv channels (q, k: 2 heads of 8; v: 4 of 8), value heads


def whole_sequence(hf, ids):
    """transformers' logits at every position of `ids`, in one call without a cache."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def sequence():
    g = torch.Generator().manual_seed(1)
    return [int(x) for x in torch.randint(2, 160, (44,), generator=g)]


def test_the_kernel_over_t_tokens_equals_the_recurrence_a_token_at_a_time():
    """llama::gated_delta_rule over 29 tokens from a nonzero state, against the loop Core ML's
    programs unroll: the same outputs and final state."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    from edgellm.architectures.qwen3_5 import GatedDeltaNet

    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 29, 4, 8, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 29, 4, 6, generator=g)
    decay, beta = torch.rand(1, 29, 4, generator=g), torch.rand(1, 29, 4, generator=g)
    state = torch.randn(1, 4, 8, 6, generator=g)
    by_kernel = GatedDeltaNet._op(q, k, v, decay, beta, state)
    by_token = GatedDeltaNet._loop(q, k, v, decay, beta, state)
    for a, b in zip(by_kernel, by_token):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(by_token[1], state)  # the state moved


@pytest.mark.parametrize("prompt", [1, 7, 29])
def test_program_takes_a_prompt_of_any_length_in_one_call(tiny_models, exported, sequence,
                                                          prompt):
    """The prompt in one call (T dynamic: the kernel runs the recurrence over every token), then
    a token per call to position 44, against transformers over the whole sequence; a second
    sequence in the same program starts from zeroed states."""
    from edgellm.program import Program

    hf = tiny_models["qwen3_5_text"][1]
    folder, report = exported("qwen3_5_text", **XNNPACK)
    program = Program(folder / "model.pte")
    expected = whole_sequence(hf, sequence)[prompt - 1:]
    for _ in range(2):
        rows = [program.forward(torch.tensor([sequence[:prompt]]), torch.tensor([0]))[0]]
        for t in range(prompt, len(sequence) - 1):
            rows.append(program.forward(torch.tensor([[sequence[t]]]), torch.tensor([t]))[0])
        assert_logits_close(torch.stack(rows), expected[:len(rows)], atol=1e-4,
                            what=f"qwen3.5 program, prompt of {prompt}")
    ops = report["methods"]["forward"]["delegation"]["by_op"]
    assert ops["llama_gated_delta_rule_default"] == {"delegated": 0, "non_delegated": 1}


def test_prefill_and_forward_continue_one_sequence(tiny_models, exported, sequence):
    """29 tokens as 3 calls of `prefill` (8 each) and one of `forward` (5): both methods read and
    write the same conv and recurrent states (one buffer each for both methods)."""
    from edgellm.program import Program

    hf = tiny_models["qwen3_5_text"][1]
    program = Program(exported("qwen3_5_text", **XNNPACK)[0] / "model.pte")
    rows = [program.prefill(sequence[:29])[0]]
    for t in range(29, len(sequence) - 1):
        rows.append(program.forward(torch.tensor([[sequence[t]]]), torch.tensor([t]))[0])
    expected = whole_sequence(hf, sequence)[28:]
    assert_logits_close(torch.stack(rows), expected[:len(rows)], atol=1e-4,
                        what="qwen3.5 prefill then forward")


def test_state_report_names_both_deltanet_buffers_and_keeps_the_recurrence_float(tiny_models,
                                                                                 exported):
    """The DeltaNet layer keeps its conv state (kernel 4: 3 steps) and a key x value matrix per
    value head; the attention layer its KV cache. In fp16 the recurrent state stays float32."""
    report = exported("qwen3_5_text", **XNNPACK)[1]["state"]
    deltanet, attention = report["layers"]
    assert deltanet["conv_state"] == [1, CONV, 3] and "k_cache" not in deltanet
    assert deltanet["recurrent_state"] == [1, HEADS, DK, DV]
    assert deltanet["bytes"] == 4 * (CONV * 3 + HEADS * DK * DV)
    assert attention["k_cache"] == [1, 48, 2, 16] and "recurrent_state" not in attention
    assert report["dtypes"] == {"conv_state": "float32", "recurrent_state": "float32",
                                "k_cache": "float32", "v_cache": "float32"}
    md = (exported("qwen3_5_text", **XNNPACK)[0] / "report.md").read_text()
    assert "(conv_state float32, recurrent_state float32, k_cache float32, v_cache float32)" in md
    hf = tiny_models["qwen3_5_text"][1]
    half = build_model(hf.config, hf.state_dict(), ModelOptions(48), torch.float16)
    assert state_report(half)["dtypes"] == {"conv_state": "float16",
                                            "recurrent_state": "float32",
                                            "k_cache": "float16", "v_cache": "float16"}


def test_coreml_takes_both_methods_whole_with_the_recurrence_written_out(exported):
    """forward (a token a call) and a prefill of 8 tokens: the recurrence unrolled in plain ops,
    one delegate per method, nothing computed outside, the MIL histogram in the report."""
    report = exported("qwen3_5_text", backends="coreml", prefill_chunk=8, **SIZES)[1]
    for method in ("forward", "prefill"):
        d = report["methods"][method]["delegation"]
        assert d["subgraphs"] == 1 and d["non_delegated_compute_nodes"] == 0, method
    delegates = {d["method"]: d for d in report["delegates"]["coreml"]}
    assert delegates["prefill"]["mil_histogram"]["matmul"] > delegates["forward"][
        "mil_histogram"]["matmul"]  # 8 steps of the recurrence against 1


@pytest.mark.parametrize("state", ["io", "coreml"])
def test_coreml_keeps_the_deltanet_state_where_the_policy_says(exported, state):
    report = exported("qwen3_5_text", backends="coreml", overrides=[f"coreml.state={state}"],
                      **SIZES)[1]
    [delegate] = report["delegates"]["coreml"]
    deltanet = {"model_layers_0_linear_attn_conv_state": [1, 3, CONV],  # time-major on Core ML
                "model_layers_0_linear_attn_recurrent_state": [1, HEADS, DK, DV]}
    if state == "io":
        inputs = {f["name"]: f["shape"] for f in delegate["inputs"]}
        assert {n: inputs[f"b_{n}"] for n in deltanet} == deltanet and delegate["states"] == []
    else:
        states = {f["name"]: f["shape"] for f in delegate["states"]}
        assert {n: states[n] for n in deltanet} == deltanet and len(states) == 4


def test_8da4w_applies_and_the_recurrence_stays_float(exported):
    """Verified: the program against the eager quantized model, and both against fp32."""
    report = exported("qwen3_5_text", quantize="8da4w", group_size=32,
                      **dict(SIZES, verify=True))[1]
    checks = {c["level"]: c["passed"] for c in report["verify"]["checks"]}
    assert checks == {"rewrite": True, "program": True, "quantization": True}
    # 5 in the DeltaNet layer, 5 in the attention one (q, k, v, its gate, o), 2 x 3 MLP, the head
    assert report["quantization"]["linears_quantized"] == 17
    assert report["state"]["dtypes"]["recurrent_state"] == "float32"


def test_a_qwen3_5_folder_exports_its_text_decoder(tmp_path, tiny_models, capsys):
    """A qwen3_5 folder (vision tower and text decoder, head tied in the outer config): the text
    decoder computes what the multimodal model computes on text; the rest is left out, said."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from edgellm.backends import plan_for
    from edgellm.config import ExportConfig
    from edgellm.eager import eager_model
    from edgellm.progress import Stages
    from edgellm.sources import load_source

    text = tiny_models["qwen3_5_text"][1].config
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=14)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path / "q")
    source = load_source(str(tmp_path / "q"))
    assert source.hf_config.model_type == "qwen3_5_text" and source.hf_config.tie_word_embeddings
    assert source.notes == ["[edgellm] load: the text decoder of this qwen3_5 folder exports; "
                            f"{len(hf.model.visual.state_dict())} tensors of its other parts "
                            "(vision tower, projector, multi-token prediction) are left out"]
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    ids = [5, 17, 3, 99, 42, 7]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        actual = model(torch.tensor([ids]), torch.tensor([0]))[0]
    assert_logits_close(actual[None], expected[None], atol=1e-4, what="qwen3_5 text decoder")
    cfg = ExportConfig(model=str(tmp_path / "q"), max_seq_len=4, max_context_len=8)
    eager_model(cfg, plan_for(cfg), Stages())  # the load stage says it on stderr
    assert source.notes[0] in capsys.readouterr().err
