"""Speed of an exported program on this machine, against the memory-bandwidth floor measured in the
same run (as gpt-fast reports GB/s beside tok/s).

Decode on a CPU reads every weight once per token, so the fastest possible decode step takes
`weight bytes / memory bandwidth`; `floor_fraction` is that time over the measured step (1.0 would
be as fast as memory allows). Weight bytes come from the export report (`weight_bytes_per_token`:
every weight the head and layers read, each shared tensor once; an untied embedding table counts
one row), or the .pte size for a program whose report does not say.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..errors import InputError


def bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Memory read bandwidth: the best of `repeats` sums over a tensor far larger than caches, on
    every core this process may use (also when OMP_NUM_THREADS=1 keeps programs' OpenMP teams to
    one thread, edgellm/run/openmp.py: torch's own threads here are this thread's setting, so it can
    be raised)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best, threads = float("inf"), torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or threads)  # the cores this process may use
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return x.numel() * 4 / best / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(target, prompt_lengths=(64,), steps: int = 32, repeats: int = 3,
          depths=()) -> dict:
    """Load time, time to first token, prefill tok/s per prompt length, decode tok/s (median
    per-token time over `steps` calls, best of `repeats` runs), peak RSS and effective bandwidth;
    with `depths`, prefill (of the first prompt length) and decode again after a context of each
    many tokens, with the floor of the bytes a step reads there (at_depths)."""
    from ..memory import peak_rss_mb
    from ..program import Program, native_logs

    pte = Path(target) / "model.pte" if Path(target).is_dir() else Path(target)
    t0 = time.perf_counter()
    program = Program(pte)
    load_s = time.perf_counter() - t0
    lengths = [n for n in prompt_lengths if n + steps <= program.max_context_len]
    if not lengths:
        raise InputError(f"Every prompt length in {list(prompt_lengths)} plus {steps} decode "
                         f"steps exceeds max_context_len {program.max_context_len}; give "
                         "shorter --prompt-lengths or fewer --steps.")
    deep = [d for d in depths if d < 0 or d + lengths[0] + steps > program.max_context_len
            and not program.sink]  # a program with attention sinks takes any depth
    if deep:
        raise InputError(f"Depth {deep[0]} plus a {lengths[0]}-token prompt and {steps} decode "
                         f"steps does not fit max_context_len {program.max_context_len}; give "
                         f"depths up to {program.max_context_len - lengths[0] - steps}, or "
                         "export with a larger --max-context-len.")
    vocab = int(program.meta.get("get_vocab_size", 1000))
    g = torch.Generator().manual_seed(0)
    prefill_s: dict[int, float] = {}
    decode_s = float("inf")
    with native_logs():
        for _ in range(repeats):
            for n in lengths:
                ids = torch.randint(0, vocab, (n,), generator=g).tolist()
                prefill_s[n] = min(prefill_s.get(n, float("inf")),
                                   timed(lambda: program.prefill(ids)))
            decode_s = min(decode_s, decode_step(program, lengths[0], steps))
    rss, report = peak_rss_mb(), report_of(pte)
    deep = at_depths(program, sorted(set(depths)), lengths[0], steps, repeats) if depths else {}
    out = figures(pte, report, load_s, prefill_s, decode_s, rss)  # (bandwidth: 1 GB of RSS)
    for d, row in deep.get("by_depth", {}).items():
        cache = cache_bytes_read(report, int(d))
        floor = (out["weight_bytes_per_token"] + cache) / (out["bandwidth_gbs"] * 1e9)
        row.update(cache_bytes_read=cache, floor_ms=round(floor * 1e3, 2),
                   floor_fraction=round(floor * row["decode_tok_s"], 3))
    return {**out, **deep}


def at_depths(program, depths: list[int], n: int, steps: int, repeats: int) -> dict:
    """Prefill of `n` tokens and decode after a context of each depth (ascending: the context is
    filled once, each depth continuing the last), best of `repeats`; peak RSS after each (cache
    pages count once written)."""
    from ..memory import peak_rss_mb
    from ..program import native_logs

    g = torch.Generator().manual_seed(1)
    vocab = int(program.meta.get("get_vocab_size", 1000))
    rows, filled = {}, 0
    with native_logs():
        for d in depths:
            if d > filled:
                program.prefill(torch.randint(0, vocab, (d - filled,), generator=g).tolist(),
                                filled)
                filled = d
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            prefill = min(timed(lambda: program.prefill(ids, d)) for _ in range(repeats))
            decode = min(decode_step(program, d, steps) for _ in range(repeats))
            rows[str(d)] = {"prefill_tok_s": round(n / prefill, 1),
                            "decode_tok_s": round(1 / decode, 2),
                            "peak_rss_mb": round(peak_rss_mb())}
    return {"depth_prompt_tokens": n, "by_depth": rows,
            **{f"{k}_by_depth": {d: r[k] for d, r in rows.items()}
               for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb")}}


def report_of(pte: Path) -> dict:
    """The export report beside a program, or {} when there is none."""
    report = pte.parent / "report.json"
    return json.loads(report.read_text()) if report.is_file() else {}


def cache_bytes_read(report: dict, depth: int) -> int:
    """KV cache bytes a decode step reads after `depth` tokens: every layer's cached positions in
    reach, kv_cache.bytes_per_position times min(depth, slots) (a ring or sink cache stops
    growing at its slots); 0 where the report does not say."""
    return sum(r["bytes_per_position"] * min(depth, r["slots"])
               for r in report.get("kv_cache", {}).get("layers", []))


def decode_step(program, start: int, steps: int) -> float:
    """Median seconds per single-token forward call from position `start`."""
    times = []
    tok = torch.tensor([[1]])
    for i in range(steps):
        times.append(timed(lambda: program.forward(tok, torch.tensor([start + i]))))
    return statistics.median(times)


def figures(pte: Path, report: dict, load_s, prefill_s, decode_s, rss) -> dict:
    weights = report.get("weight_bytes_per_token") or pte.stat().st_size
    bw = bandwidth_gbs()
    floor_s = weights / (bw * 1e9)
    first = min(prefill_s)
    return {"program": str(pte), "load_s": round(load_s, 3),
            "ttft_s": round(prefill_s[first], 4), "ttft_prompt_tokens": first,
            "prefill_tok_s": {str(n): round(n / s, 1) for n, s in prefill_s.items()},
            "decode_tok_s": round(1 / decode_s, 2), "decode_ms": round(decode_s * 1e3, 2),
            "peak_rss_mb": round(rss), "weight_bytes_per_token": weights,
            "effective_gbs": round(weights / decode_s / 1e9, 2),
            "bandwidth_gbs": round(bw, 2), "floor_ms": round(floor_s * 1e3, 2),
            "floor_fraction": round(floor_s / decode_s, 3),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def table(r: dict) -> str:
    rows = [("load", f"{r['load_s']:.2f} s"),
            ("time to first token", f"{r['ttft_s'] * 1e3:.1f} ms ({r['ttft_prompt_tokens']}-token "
                                    "prompt)")]
    rows += [(f"prefill {n}", f"{v} tok/s") for n, v in r["prefill_tok_s"].items()]
    rows += [("decode", f"{r['decode_tok_s']} tok/s ({r['decode_ms']} ms/token)"),
             ("weights read per token", f"{r['weight_bytes_per_token'] / 1e6:.1f} MB"),
             ("effective bandwidth", f"{r['effective_gbs']} GB/s"),
             ("memory bandwidth (measured now)", f"{r['bandwidth_gbs']} GB/s"),
             ("decode floor", f"{r['floor_ms']} ms/token; decode at {r['floor_fraction']:.0%} "
                              "of the floor"),
             ("peak RSS", f"{r['peak_rss_mb']} MB"),
             *[(f"at depth {d}", f"prefill {x['prefill_tok_s']} tok/s ({r['depth_prompt_tokens']}"
                f" tokens), decode {x['decode_tok_s']} tok/s, {x['floor_fraction']:.0%} of the "
                f"floor ({x['cache_bytes_read'] / 1e6:.1f} MB of cache read), peak RSS "
                f"{x['peak_rss_mb']} MB") for d, x in r.get("by_depth", {}).items()],
             ("OMP_NUM_THREADS", r.get("omp_num_threads") or "unset (OpenMP's default)")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
