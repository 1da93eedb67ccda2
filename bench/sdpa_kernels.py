"""ExecuTorch's attention kernels against each other, one layer's call: `llama::custom_sdpa` over
float caches and `llama::custom_quantized_sdpa` over int8 ones (the int8 KV cache's), at SmolLM2-
135M's heads (9 query, 3 KV, 64 wide) by default; decode (1 token) and a prefill chunk, at
positions given. Best of 5 calls each; the same C++ kernels the runtime runs.

usage: python bench/sdpa_kernels.py [--context 4096] [--positions 1024,4000] [--threads 1]
"""

import argparse
import json
import time

import speed_vs_anchor  # noqa: F401  sets OMP_NUM_THREADS=1 before torch loads

import torch  # noqa: E402

import executorch.extension.llm.custom_ops.custom_ops  # noqa: E402,F401  llama:: kernels
import executorch.kernels.quantized  # noqa: E402,F401
from edgellm.architectures.cache import quantize_rows  # noqa: E402


def best_ms(fn, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--positions", default="1024,4000")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    H, kv, D = (int(x) for x in a.heads.split(","))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, a.context, kv, D, generator=g) for _ in range(2))
    (kq, ks, kz), (vq, vs, vz) = quantize_rows(k), quantize_rows(v)
    rows = []
    print("| tokens | position | custom_sdpa ms | custom_quantized_sdpa ms | ratio |\n"
          "|---|---|---|---|---|")
    for T in (1, a.prefill):
        q = torch.randn(1, T, H, D, generator=g)
        qq, qs, qz = quantize_rows(q)
        for pos in (int(x) for x in a.positions.split(",")):
            pos = min(pos, a.context - T)
            fp = best_ms(lambda: torch.ops.llama.custom_sdpa(q, k, v, pos, None, 0.0, True, None))
            q8 = best_ms(lambda: torch.ops.llama.custom_quantized_sdpa(
                qq, kq, vq, pos, None, 0.0, True, None, qz, qs, kz, ks, vz, vs))
            rows.append({"tokens": T, "position": pos, "float_ms": round(fp, 3),
                         "int8_ms": round(q8, 3), "ratio": round(q8 / fp, 2)})
            print(f"| {T} | {pos} | {fp:.3f} | {q8:.3f} | {q8 / fp:.2f} |")
    print(json.dumps({"heads": [H, kv, D], "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
