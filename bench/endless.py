"""A program with attention sinks generating far past its context: decode speed and resident
memory every 1,000 tokens, greedy from a prompt of the shipped text.

usage: python bench/endless.py OUT [--tokens 10000] [--every 1000]

OUT is an export folder (`edgellm export ... --attention-sink SINK,WINDOW`). Prints a row per
segment (tokens, decode tok/s over the segment, RSS after it); the last line is one JSON object.
"""

import argparse
import json
import time
from pathlib import Path

import speed_vs_anchor  # noqa: F401  sets OMP_NUM_THREADS=1 before torch loads

from edgellm.memory import peak_rss_mb, rss_mb  # noqa: E402
from edgellm.program import Program, greedy, native_logs  # noqa: E402
from edgellm.sources.base import load_tokenizer  # noqa: E402
from edgellm.verification import TEXT  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--every", type=int, default=1_000)
    a = p.parse_args()
    program = Program(Path(a.out) / "model.pte")
    if not program.sink:
        raise SystemExit(f"{a.out} has no attention sinks: it stops at max_context_len "
                         f"{program.max_context_len}")
    prompt = load_tokenizer(Path(a.out)).encode(TEXT.read_text()).ids[:program.max_seq_len]
    rows, t0, n = [], time.perf_counter(), 0
    print(f"sink, window {program.sink}, max_context_len {program.max_context_len}\n"
          "| tokens | decode tok/s (segment) | RSS MB |\n|---|---|---|")
    with native_logs():
        for n, _ in enumerate(greedy(program.forward, program.prefill, prompt, a.tokens, set()),
                              start=1):
            if n % a.every == 0:
                now = time.perf_counter()
                rows.append({"tokens": n, "tok_s": round(a.every / (now - t0), 2),
                             "rss_mb": rss_mb()})
                print(f"| {n} | {rows[-1]['tok_s']} | {rows[-1]['rss_mb']} |", flush=True)
                t0 = now
    print(json.dumps({"program": a.out, "sink": program.sink, "tokens": n, "segments": rows,
                      "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
    main()
