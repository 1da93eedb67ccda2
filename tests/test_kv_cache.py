"""Long contexts: the int8 KV cache (ExecuTorch's quantized cache: llama::update_cache of int8
values, scales and zero points, llama::custom_quantized_sdpa), what the report says of the
caches, Core ML's state policy settled by what `io` moves per call, and `bench --depth`."""

import json

import pytest
import torch

import edgellm
from conftest import LONG, WINDOW
from edgellm.architectures import build_model
from edgellm.architectures.cache import float_caches
from edgellm.architectures.layers import ModelOptions
from edgellm.backends import BACKENDS
from edgellm.cli import main
from edgellm.numerics import compare
from test_families import ladder_run, transformers_run

FAST = dict(verify=False, etrecord=False, **LONG)
INT8 = dict(FAST, kv_cache="int8")


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(0)
    return [int(x) for x in torch.randint(2, 160, (12,), generator=g)]


def test_int8_cache_program_past_every_window(tiny_models, exported, prompt):
    """Gemma 3 (a ring of WINDOW beside a global layer, one KV head) with int8 caches, 40
    positions through the ladder (prompt, single tokens, 16 tokens onto a wrapped ring): the
    program is the eager int8 model to float rounding, and within the cache's bounds of
    transformers, which the same eager model with float caches matches exactly."""
    from edgellm.program import Program

    folder, hf = tiny_models["gemma3_text"]
    tokens, expected = transformers_run(hf, prompt)
    rows, program = ladder_run(Program(exported("gemma3_text", **INT8)[0] /
                                       "model.pte").forward, prompt, tokens)
    writing = {**BACKENDS["xnnpack"].writing, "kv_cache": "int8"}
    opts = ModelOptions(max_context_len=LONG["max_context_len"],
                        max_call_len=LONG["max_seq_len"], **writing)
    from edgellm.sources import load_source

    source = load_source(str(folder))
    model = build_model(source.hf_config, source.state_dict, opts, torch.float32)
    with torch.no_grad():
        _, eager = ladder_run(model, prompt, tokens)
        with float_caches(model):
            _, floats = ladder_run(model, prompt, tokens)
    assert compare(program, eager).sqnr_db > 60  # ExecuTorch's own int8 math (a row on a rounding
    # boundary may land one level apart)
    assert compare(floats, expected[rows]).sqnr_db > 100  # float caches: transformers exactly
    cost = compare(program, expected[rows])
    assert cost.sqnr_db > 30 and cost.argmax_agree >= 0.9, cost
    assert cost.sqnr_db < 90  # and the int8 cache did quantize something


def test_int8_cache_bytes_and_shapes_in_the_report(exported):
    """Per (token, head) row: D int8 values, a float32 scale and an int8 zero point, in the
    context's slots (a ring's for the sliding layer)."""
    floats = exported("gemma3_text", **FAST)[1]["kv_cache"]
    report = exported("gemma3_text", **INT8)[1]
    kv, ring, ctx = report["kv_cache"], WINDOW + LONG["max_seq_len"] - 1, LONG["max_context_len"]
    assert (floats["dtype"], kv["dtype"]) == ("float32", "int8")
    assert [(r["slots"], r["window"], r["k_cache"], r["k_cache_scales"]) for r in kv["layers"]] \
        == [(ring, WINDOW, [1, ring, 1, 16], [1, ring, 1, 1]),
            (ctx, None, [1, ctx, 1, 16], [1, ctx, 1, 1])]
    assert kv["bytes"] == 2 * (16 + 4 + 1) * (ring + ctx)  # k and v
    assert kv["bytes_per_position"] == 2 * 2 * (16 + 4 + 1)  # two layers
    assert kv["bytes"] / floats["bytes"] == (16 + 5) / (4 * 16)  # 0.27 at SmolLM2's head_dim 64
    assert report["state"]["dtypes"]["k_cache"] == "int8"
    assert report["state"]["dtypes"]["k_cache_scales"] == "float32"


def test_verify_reports_what_the_int8_cache_costs(exported):
    """The export's verification measures the cache like a recipe: the program against the same
    model with float caches along the shipped text (SQNR, top-1, perplexity), beside the usual
    checks, which it passes."""
    folder, report = exported("llama", kv_cache="int8")
    checks = {c["level"]: c for c in report["verify"]["checks"]}
    assert report["verify"]["passed"] and set(checks) == {"rewrite", "program", "quantization",
                                                          "kv cache"}
    cache = checks["kv cache"]
    assert cache["passed"] and (cache["min_sqnr_db"], cache["min_top1"]) == (30.0, 0.9)
    assert cache["note"].startswith("int8 KV cache: the fp32 model against itself with fp32 "
                                    "caches, before any weight recipe, along")
    assert cache["sqnr_db"] < 90  # the int8 cache did quantize something
    assert checks["rewrite"]["sqnr_db"] > 100  # the rewrite is measured with float caches
    ppl = report["verify"]["perplexity"]
    assert ppl["model_fp32_caches"] == pytest.approx(ppl["transformers_fp32"], rel=1e-4)
    assert ppl["model_int8_caches"] == pytest.approx(ppl["program"], rel=1e-3)
    md = (folder / "report.md").read_text()
    assert "kv cache: ok" in md and "- KV cache: int8," in md


@pytest.mark.parametrize("backends, why", [
    ("coreml", r"kv_cache: int8 on coreml: ExecuTorch's int8 cache is read by "
               r"llama::custom_quantized_sdpa, a CPU kernel that coremltools cannot convert"),
    ("vulkan", r"kv_cache: int8 on vulkan: ExecuTorch's Vulkan delegate registers "
               r"llama::custom_sdpa over float caches but no llama::custom_quantized_sdpa"),
    ("coreml,xnnpack", r"kv_cache: int8 on coreml:.*Backends with an int8 KV cache: xnnpack, "
                       r"portable")])
def test_int8_cache_is_refused_where_the_backend_has_no_kernel(tiny_models, tmp_path, capsys,
                                                               backends, why):
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"),
                 "--backend", backends, "--kv-cache", "int8"]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(why, err), err
    assert not (tmp_path / "o").exists()


def test_unknown_cache_dtype_is_one_problem(tiny_models, tmp_path):
    with pytest.raises(edgellm.ConfigError) as e:
        edgellm.export(tiny_models["llama"][0], output=tmp_path / "o", kv_cache="int4")
    assert e.value.problems == ["kv_cache: 'int4' is not one of int8 (leave it unset for caches "
                                "in the model's dtype)"]


def test_portable_int8_program_is_the_xnnpack_one(tiny_models, exported, prompt):
    """Portable has no custom ops of its own: an int8 cache makes it write attention with
    ExecuTorch's llama:: ops, the same kernels as XNNPACK's program, so the same logits."""
    from edgellm.program import Program

    tokens, _ = transformers_run(tiny_models["gemma3_text"][1], prompt)
    runs = [ladder_run(Program(exported("gemma3_text", backends=b, **INT8)[0] /
                               "model.pte").forward, prompt, tokens)[1]
            for b in ("portable", "xnnpack")]
    assert compare(*runs).sqnr_db > 60  # (XNNPACK's linears round apart: a level may flip)


def test_coreml_state_policy_is_settled_by_what_io_moves():
    """`state: auto` keeps io until the caches io copies in and out per decode call outweigh the
    weights a step reads; then the caches stay inside Core ML. Asked-for policies stand."""
    from edgellm.backends.coreml import CoreMLOptions, settle
    from edgellm.config import ExportConfig

    cfg, auto = ExportConfig(), CoreMLOptions()
    short, entry = settle(cfg, auto, 6_000_000, 270_000_000)  # SmolLM2 fp16 at 128 tokens
    assert short.state == "io" and entry["reason"].startswith("io moves 12.0 MB in and out per "
                                                              "decode call, 4% of the 270.0 MB")
    assert entry["bytes_per_decode_call"] == {"io": {"in": 6_000_000, "out": 6_000_000},
                                              "coreml": {"in": 0, "out": 0}}
    long, entry = settle(cfg, auto, 189_000_000, 270_000_000)  # at 4096
    assert long.state == "coreml" and "io would move 378.0 MB" in entry["reason"]
    chunked = ExportConfig(prefill_chunk=8)
    assert settle(chunked, auto, 189_000_000, 270_000_000)[0].state == "io"
    asked = CoreMLOptions(state="io")
    assert settle(cfg, asked, 189_000_000, 1)[1]["reason"] == "asked for (coreml.state)"


def test_coreml_report_says_which_state_policy_and_why(exported):
    folder, report = exported("llama", backends="coreml")
    entry = report["kv_cache"]["coreml"]
    assert entry["state_policy"] == "io" and entry["bytes_per_decode_call"]["io"]["in"] == \
        report["state"]["bytes"]
    assert f"- coreml state: io ({entry['reason']})" in (folder / "report.md").read_text()


def test_bench_measures_at_each_depth(exported, capsys):
    """A row per depth, the cache bytes a step reads there counted into its floor."""
    folder, report = exported("llama", kv_cache="int8")
    assert main(["bench", str(folder), "--prompt-lengths", "4", "--steps", "4", "--repeats", "1",
                 "--depth", "0,8,20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    per_position = report["kv_cache"]["bytes_per_position"]
    assert list(r["by_depth"]) == ["0", "8", "20"]
    assert [row["cache_bytes_read"] for row in r["by_depth"].values()] == [
        0, 8 * per_position, 20 * per_position]
    assert set(r["decode_tok_s_by_depth"]) == set(r["prefill_tok_s_by_depth"]) == \
        set(r["peak_rss_mb_by_depth"]) == {"0", "8", "20"}
    assert all(v > 0 for v in r["decode_tok_s_by_depth"].values())
    floor = (r["weight_bytes_per_token"] + 20 * per_position) / (r["bandwidth_gbs"] * 1e9)
    assert r["by_depth"]["20"]["floor_ms"] == pytest.approx(floor * 1e3, abs=0.01)
    assert any(line.startswith("at depth 20") for line in lines)


def test_bench_refuses_a_depth_the_context_cannot_hold(exported, capsys):
    folder = exported("llama", kv_cache="int8")[0]
    assert main(["bench", str(folder), "--prompt-lengths", "4", "--steps", "4",
                 "--depth", "0,25"]) == 2
    assert ("Depth 25 plus a 4-token prompt and 4 decode steps does not fit max_context_len 32; "
            "give depths up to 24") in capsys.readouterr().err


def test_memory_budget_refuses_up_front_with_what_it_would_take(tiny_models, tmp_path, capsys):
    """The tiny Llama at 256 positions: 329.5 KB of weights and 128 KB of fp32 caches (512 bytes
    a position: 2 layers x k and v x 2 heads x 16 x 4 bytes). A 400K budget leaves room for 141
    positions; the refusal comes before verification's reference runs or any export."""
    assert main(["export", str(tiny_models["llama"][0]), "-o", str(tmp_path / "o"),
                 "--max-seq-len", "16", "--max-context-len", "256", "--memory-budget",
                 "400K"]) == 2
    err = capsys.readouterr().err
    assert ("A context of 256 needs 457.50 KB: 329.50 KB of weights and 128.00 KB of state "
            "(128.00 KB of float32 KV caches), over --memory-budget 400K. Either lower "
            "--max-context-len to 141 (the longest that fits) or --kv-cache int8 (caches of "
            "42.00 KB instead of 128.00 KB, on xnnpack and portable).") in err
    assert "reference" not in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("text, size", [("4GB", 4 * 2**30), ("512MB", 512 * 2**20),
                                        ("1.5G", 3 * 2**29), ("4GiB", 4 * 2**30),
                                        ("1000", 1000)])
def test_memory_budget_reads_sizes(text, size):
    from edgellm.config import parse_size

    assert parse_size(text) == size


def test_memory_budget_that_is_no_size_is_refused(tiny_models, tmp_path):
    with pytest.raises(edgellm.ConfigError) as e:
        edgellm.export(tiny_models["llama"][0], output=tmp_path / "o", memory_budget="lots")
    assert e.value.problems == ["memory_budget: 'lots' is not a size; give e.g. 4GB, 512MB or a "
                                "number of bytes"]


def test_a_32k_context_runs_at_its_far_end(tiny_models, tmp_path):
    """Nothing in the program is sized for short contexts: at max_context_len 32768 a call at
    position 32767 gives the eager model's logits (the cache between holds zeros, on both
    sides)."""
    from edgellm.program import Program
    from edgellm.sources import load_source

    folder = tiny_models["llama"][0]
    sizes = dict(max_seq_len=16, max_context_len=32768)
    edgellm.export(folder, output=tmp_path / "o", verify=False, allow_long_context=True,
                   quiet=True, **sizes)
    program = Program(tmp_path / "o" / "model.pte")
    source = load_source(str(folder))
    opts = ModelOptions(max_context_len=32768, max_call_len=16, **BACKENDS["xnnpack"].writing)
    model = build_model(source.hf_config, source.state_dict, opts, torch.float32)
    calls = [([5, 6, 7, 8], 0), ([9, 10], 32000), ([11], 32767)]
    with torch.no_grad():
        for ids, start in calls:
            got = program.forward(torch.tensor([ids]), torch.tensor([start]))
            want = model(torch.tensor([ids]), torch.tensor([start]))
            assert compare(got, want).sqnr_db > 60, start
