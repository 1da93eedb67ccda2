"""The families beyond LFM2, Llama and Qwen (conftest.FAMILIES): LFM3, Gemma 3, Mistral,
Ministral, SmolLM3, Phi-3, Granite, OLMo 2, Qwen3.5, LFM2-MoE, Qwen3-MoE. Each climbs the parity
ladder against transformers (eager in every backend's formulation, then the XNNPACK program) over
40 tokens, past every sliding window (8) and ring buffer several times; Gemma 3 lowers whole to
Core ML (every family on every backend: bench/families.py matrix); and what no family can take is
refused by name."""

import json

import pytest
import torch

from conftest import FAMILIES, LONG, WINDOW, assert_logits_close
from edgellm.architectures import build_model
from edgellm.architectures.layers import ModelOptions
from edgellm.backends import BACKENDS
from edgellm.cli import main
from edgellm.verification import sequence_logits

STEPS = 28  # decode calls after a 12-token prompt: 40 positions, five windows of 8
FORMULATIONS = {name: b.writing for name, b in BACKENDS.items()}


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(0)
    return [int(x) for x in torch.randint(2, 160, (12,), generator=g)]


def transformers_run(hf, prompt, steps=STEPS):
    """Greedy tokens and the logits row after the prompt and after each token but the last.
    transformers recomputes the whole sequence each step, except for Phi-3, whose LongRoPE picks
    its factors by the sequence length of each call: there transformers runs with its cache, a
    token per call, which is what a program does."""
    from transformers import DynamicCache

    ids, rows = list(prompt), []
    cache = DynamicCache(config=hf.config) if hf.config.model_type == "phi3" else None
    with torch.no_grad():
        row = hf(torch.tensor([ids]), past_key_values=cache, use_cache=cache is not None).logits
        for _ in range(steps):
            rows.append(row[0, -1])
            ids.append(int(rows[-1].argmax()))
            step = [ids[-1:]] if cache is not None else [ids]
            row = hf(torch.tensor(step), past_key_values=cache, use_cache=cache is not None).logits
    return ids[len(prompt):], torch.stack(rows)


def ladder_run(forward, prompt, tokens):
    """The prompt in one call, ten tokens a call each, then 16 tokens in one call (onto a ring
    that has wrapped), then the last a call. Returns (the reference rows those calls' last
    logits compare with, the logits)."""
    def call(ids, start):
        return forward(torch.tensor([ids]), torch.tensor([start]))[0]

    n, rows, out = len(prompt), [0], [call(prompt, 0)]
    for j in range(10):
        out.append(call([tokens[j]], n + j))
        rows.append(j + 1)
    out.append(call(tokens[10:26], n + 10))
    rows.append(26)
    out.append(call([tokens[26]], n + 26))
    rows.append(27)
    return rows, torch.stack(out)


@pytest.fixture(scope="module")
def references(tiny_models, prompt):
    return {f: transformers_run(tiny_models[f][1], prompt) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("writing", FORMULATIONS.values(), ids=FORMULATIONS.keys())
def test_eager_matches_transformers_past_every_window(tiny_models, prompt, references, family,
                                                      writing):
    _, hf = tiny_models[family]
    tokens, expected = references[family]
    opts = ModelOptions(LONG["max_context_len"], max_call_len=LONG["max_seq_len"], **writing)
    model = build_model(hf.config, hf.state_dict(), opts, torch.float32)
    with torch.no_grad():
        rows, actual = ladder_run(model, prompt, tokens)
        # verification's eager runs: every position's logits, calls of max_seq_len tokens
        every = sequence_logits(model, prompt + tokens[:-1], LONG["max_seq_len"])
        again = ladder_run(model, prompt, tokens)[1]  # a new sequence sees nothing of the last
    assert_logits_close(actual, expected[rows], atol=1e-4, what=f"{family} {writing}")
    assert_logits_close(every[len(prompt) - 1:], expected, atol=1e-4,
                        what=f"{family} {writing}, every position")
    assert torch.equal(actual, again)  # and afterwards the last token's logits only, as before


def test_a_window_changes_what_the_model_computes(tiny_models, prompt, references):
    """The parity above means something: the same Mistral with a full cache in every layer
    drifts from transformers once the run passes its window."""
    import copy

    _, hf = tiny_models["mistral"]
    cfg = copy.deepcopy(hf.config)
    cfg.sliding_window = None
    model = build_model(cfg, hf.state_dict(), ModelOptions(48, max_call_len=16), torch.float32)
    tokens, expected = references["mistral"]
    with torch.no_grad():
        rows, actual = ladder_run(model, prompt, tokens)
    assert (actual[1:] - expected[rows][1:]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_graph_matches_transformers_past_every_window(tiny_models, prompt, references,
                                                               family):
    """The rung between eager and program: torch.export's graph (T dynamic, as XNNPACK takes
    it) run as a module."""
    from edgellm.capture import export_forward

    _, hf = tiny_models[family]
    opts = ModelOptions(LONG["max_context_len"], max_call_len=LONG["max_seq_len"],
                        **BACKENDS["xnnpack"].writing)
    model = build_model(hf.config, hf.state_dict(), opts, torch.float32)
    graph = export_forward(model, LONG["max_seq_len"], dynamic=True).module()
    tokens, expected = references[family]
    rows, actual = ladder_run(graph, prompt, tokens)
    assert_logits_close(actual, expected[rows], atol=1e-4, what=f"{family} exported graph")


# the families whose programs differ in what reaches XNNPACK: ring buffers beside full caches
# and conv states, gates, sandwich norms, GeGLU, a soft cap (LFM3, Gemma 3); a ring in every
# layer, partial rotary and LongRoPE (Phi-3). The others' ops are a subset of these
# (bench/families.py lowers every family to every backend).
PROGRAMS = ("lfm3", "gemma3_text", "phi3")
FAST = dict(verify=False, etrecord=False, **LONG)  # the test itself compares with transformers


@pytest.mark.parametrize("family", PROGRAMS)
def test_program_matches_transformers_past_every_window(exported, prompt, references, family):
    """XNNPACK `.pte` through the ExecuTorch runtime, against transformers, past every ring; its
    delegates at most one per attention layer, plus two."""
    from edgellm.program import Program

    folder, report = exported(family, **FAST)
    tokens, expected = references[family]
    rows, actual = ladder_run(Program(folder / "model.pte").forward, prompt, tokens)
    assert_logits_close(actual, expected[rows], atol=1e-4, what=f"{family} program")
    attention = sum(1 for row in report["state"]["layers"] if "k_cache" in row)
    assert report["methods"]["forward"]["delegation"]["subgraphs"] <= attention + 2


def test_report_gives_each_layers_cache_and_ring_buffers_hold_their_window(exported):
    """Gemma 3's sliding layer holds a ring of WINDOW + max_seq_len - 1 slots (a call's tokens
    never overwrite a position one of them still sees), its global layer the whole context."""
    _, report = exported("gemma3_text", **FAST)
    ring, ctx = WINDOW + LONG["max_seq_len"] - 1, LONG["max_context_len"]
    assert [(row["window"], row["k_cache"], row["v_cache"]) for row in report["state"]["layers"]] \
        == [(WINDOW, [1, ring, 1, 16], [1, ring, 1, 16]), (None, [1, ctx, 1, 16],
                                                           [1, ctx, 1, 16])]
    assert report["state"]["bytes"] == 2 * 4 * 16 * (ring + ctx)  # k and v, fp32


def test_lfm3_report_has_conv_state_and_both_caches(exported):
    _, report = exported("lfm3", **FAST)
    conv, sliding, full = report["state"]["layers"]
    assert conv["conv_state"] == [1, 64, 6] and "k_cache" not in conv  # kernel 7: 6 columns
    assert sliding["window"] == WINDOW and sliding["k_cache"][1] == WINDOW + 15
    assert full["window"] is None and full["k_cache"][1] == 48


def test_coreml_takes_the_whole_model_in_one_delegate(exported):
    """Gemma 3's ring writes, window masks, GeGLU, sandwich norms and soft cap all inside Core ML,
    in `forward` (a token per call: the ring written in place) and in a `prefill` method of 12
    tokens (the ring rewritten whole: coremltools' index_put takes one index; the eager tests
    check that write's numbers in Core ML's formulation): one delegate per method, no compute
    left outside, and the MIL op histogram in the report."""
    _, report = exported("gemma3_text", backends="coreml", prefill_chunk=12, **FAST)
    for method in ("forward", "prefill"):
        d = report["methods"][method]["delegation"]
        assert d["subgraphs"] == 1 and d["non_delegated_compute_nodes"] == 0, method
    delegates = {d["method"]: d for d in report["delegates"]["coreml"]}
    assert delegates["forward"]["mil_histogram"]["slice_update"] >= 4  # k, v of both layers


def test_gemma3_multimodal_folder_exports_its_text_tower(tmp_path, tiny_models, prompt):
    """A gemma3 folder (vision tower, projector, text decoder): the text decoder is loaded, under
    transformers 5's names, and computes what the multimodal model computes on text."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    from edgellm.sources import load_source

    text = tiny_models["gemma3_text"][1].config
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=150, boi_token_index=148, eoi_token_index=149)).eval()
    hf.save_pretrained(tmp_path / "g")
    source = load_source(str(tmp_path / "g"))
    assert source.hf_config.model_type == "gemma3_text"
    model = build_model(source.hf_config, source.state_dict, ModelOptions(32), torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
        actual = model(torch.tensor([prompt]), torch.tensor([0]))[0]
    assert_logits_close(actual[None], expected[None], atol=1e-4, what="gemma3 text tower")


def _folder_with(tmp_path, tiny_models, family, **changes):
    import shutil

    folder = tmp_path / family
    shutil.copytree(tiny_models[family][0], folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **changes}))
    return folder


@pytest.mark.parametrize("family, changes, message", [
    ("gemma3_text", {"hidden_size": -64}, r"hidden_size is -64; it must be a positive integer"),
    ("mistral", {"sliding_window": 0}, r"sliding_window is 0; it must be a positive integer"),
    ("granite", {"logits_scaling": 0.0}, r"logits_scaling is 0\.0; it must be a positive number"),
    ("olmo2", {"num_attention_heads": 3},
     r"num_attention_heads 3 does not divide hidden_size 64"),
    ("lfm3", {"num_key_value_heads": 3},
     r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_a_config_field_no_model_can_take_exits_2_naming_it(tmp_path, tiny_models, capsys,
                                                            family, changes, message):
    import re

    folder = _folder_with(tmp_path, tiny_models, family, **changes)
    assert main(["export", str(folder), "-o", str(tmp_path / "o"), "--quiet"]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_a_context_past_the_trained_positions_is_refused_unless_asked_for(tmp_path, tiny_models,
                                                                          capsys):
    from edgellm.backends import plan_for
    from edgellm.config import ExportConfig
    from edgellm.eager import eager_model
    from edgellm.progress import Stages

    folder = str(tiny_models["phi3"][0])  # max_position_embeddings 64
    assert main(["export", folder, "-o", str(tmp_path / "o"), "--quiet", "--max-seq-len", "16",
                 "--max-context-len", "80"]) == 2
    err = capsys.readouterr().err
    assert "A context of 80 is beyond the 64 positions the model was trained for " \
        "(max_position_embeddings)" in err and "--allow-long-context" in err
    cfg = ExportConfig(model=folder, max_seq_len=16, max_context_len=80, allow_long_context=True)
    eager = eager_model(cfg, plan_for(cfg), Stages(quiet=True))
    assert eager.model.model.layers[0].self_attn.cache.k_cache.shape[1] == WINDOW + 15


@pytest.mark.parametrize("model_type, reason", [
    ("gemma3n", r"Gemma 3n .*Gemma 3 \(gemma3_text"),
    ("mixtral", r"mixture-of-experts model edgellm has no architecture for; lfm2_moe and "
                r"qwen3_moe export"),
    ("gemma4", r"Gemma 4"),
    ("lfm2_vl", r"vision-language model"),
])
def test_what_no_family_covers_is_refused_by_name(tmp_path, capsys, model_type, reason):
    import re

    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert main(["export", str(folder), "-o", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"Unsupported model_type '{model_type}' \(.*{reason}", err)
    assert "Supported: lfm2, lfm3, llama, mistral" in err


def test_models_lists_every_family(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for family in ("lfm3", "gemma3_text", "gemma3", "mistral", "ministral", "smollm3", "phi3",
                   "granite", "olmo2"):
        assert f"\n  {family} " in out, family
    assert "Phi-3 and Phi-4-mini (fused projections, partial rotary, LongRoPE) " \
        "[folder, gguf, .pth]\n" in out
    assert "LongRoPE) [folder, gguf, .pth]\n" in out and "gated) [folder]\n" in out  # LFM3
