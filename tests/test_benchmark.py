"""bench's JSON line on a tiny program: every field present and sane (speed is not asserted:
benchmarks live in bench/, not in timed tests)."""

import json
import os
import subprocess
import sys

from edgellm.cli import main


def test_bench_prints_a_table_and_one_json_line(exported, capsys):
    folder, report = exported("llama")
    assert main(["bench", str(folder), "--prompt-lengths", "8,16", "--steps", "4",
                 "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    r = json.loads(lines[-1])
    assert "decode floor" in "\n".join(lines[:-1])
    assert set(r["prefill_tok_s"]) == {"8", "16"} and all(v > 0 for v in
                                                          r["prefill_tok_s"].values())
    assert r["decode_tok_s"] > 0 and r["decode_ms"] > 0 and r["load_s"] > 0
    assert r["ttft_prompt_tokens"] == 8 and r["ttft_s"] > 0
    assert r["weight_bytes_per_token"] == report["weight_bytes_per_token"]
    assert r["bandwidth_gbs"] > 0.1 and 0 < r["floor_fraction"] <= 1.5
    effective = r["weight_bytes_per_token"] * r["decode_tok_s"] / 1e9  # bytes read per second
    assert abs(r["effective_gbs"] - effective) <= 0.01 + 0.02 * effective
    assert r["peak_rss_mb"] > 0


def test_weight_bytes_count_shared_storage_once(tiny_models, exported):
    """The tiny Llama is untied: its table is gathered a row at a time, its head read whole."""
    hf = tiny_models["llama"][1]
    report = exported("llama")[1]
    params = sum(p.numel() * 4 for p in hf.parameters())
    embed = hf.model.embed_tokens.weight
    assert report["weight_bytes_per_token"] == params - embed.numel() * 4 + embed.shape[1] * 4


def test_bench_refuses_prompts_longer_than_the_cache(exported, capsys):
    assert main(["bench", str(exported("llama")[0]), "--prompt-lengths", "64"]) == 2
    assert "exceeds max_context_len 32" in capsys.readouterr().err


def test_bench_runs_programs_with_one_thread_per_openmp_team(exported):
    """`edgellm bench` (its own process) sets OMP_NUM_THREADS=1 before torch loads OpenMP, unless
    the user set it; the figures say which (edgellm/run/openmp.py)."""
    folder = exported("llama")[0]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for setting, expected in ((None, "1"), ("2", "2")):
        run_env = env if setting is None else {**env, "OMP_NUM_THREADS": setting}
        out = subprocess.run([sys.executable, "-m", "edgellm.cli", "bench", str(folder),
                              "--prompt-lengths", "4", "--steps", "2", "--repeats", "1"],
                             env=run_env, capture_output=True, text=True, check=True).stdout
        assert json.loads(out.strip().splitlines()[-1])["omp_num_threads"] == expected


def test_openmp_is_left_alone_once_torch_is_imported():
    code = ("import os, torch\nfrom edgellm.run.openmp import one_thread_per_team\n"
            "print(one_thread_per_team(), os.environ.get('OMP_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["None", "None"]


def test_bandwidth_puts_torch_threads_back():
    import torch

    from edgellm.run.benchmark import bandwidth_gbs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bandwidth_gbs(megabytes=16, repeats=1) > 0.1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
