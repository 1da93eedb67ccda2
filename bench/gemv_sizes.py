"""Bytes per second of XNNPACK's 4-bit GEMV by matrix size: an expert's SwiGLU against a dense
feed-forward's, each an 8da4w program of its own, called cache-cold (issue 23).

usage: python bench/gemv_sizes.py [--widths 1792,8192] [--hidden 2048] [--bytes 128] [--rounds 7]

For each width F, enough SwiGLU feed-forwards (gate and up F x D, down D x F, 8da4w group 128,
random N(0, 0.02)) to hold about `--bytes` MB of weights, each lowered to XNNPACK alone (as
`--experts chosen` lowers an expert, with its dynamic token dimension) and called in turn for one
token, so each call reads its weights from memory. Per width: the median over rounds of the
microseconds a call takes and the bytes per second it reads. LFM2-8B-A1B's experts are F=1792,
LFM2.5-1.2B's feed-forward F=8192, both over D=2048. The last line is one JSON object.
"""

import argparse
import json
import statistics
import time

from edgellm.run.openmp import one_thread_per_team

one_thread_per_team()  # before torch is imported

import torch  # noqa: E402


def programs(width: int, hidden: int, count: int) -> list:
    from executorch.exir import EdgeCompileConfig
    from executorch.runtime import Runtime
    from torchao.quantization import quantize_

    from edgellm.architectures.moe import Expert
    from edgellm.backends import get_backend
    from edgellm.lower import _export_edge
    from edgellm.quantize.recipes import torchao_config

    class Alone(Expert):
        def forward(self, x, w):
            return (super().forward(x, w),)

    xnnpack = get_backend("xnnpack")
    tokens = torch.export.Dim("tokens", min=1, max=2048)
    out = []
    for _ in range(count):
        ffn = Alone.of(torch.randn(2 * width, hidden) * 0.02, torch.randn(hidden, width) * 0.02)
        quantize_(ffn, torchao_config(4, 128, True))
        edge = _export_edge(ffn, (torch.zeros(2, hidden), torch.zeros(2, 1)),
                            ({0: tokens}, {0: tokens}),
                            xnnpack.make_partitioners(xnnpack.options()),
                            EdgeCompileConfig(_check_ir_validity=False))
        buffer = edge.to_executorch().buffer
        program = Runtime.get().load_program(buffer)
        out.append((program.load_method("forward"), program, buffer))  # keep them alive
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1792,8192")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--bytes", type=int, default=128, help="MB of weights per width")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    from edgellm import patches
    from edgellm.backends import get_backend
    from edgellm.lower import LOWERING_PATCHES

    patches.apply(get_backend("xnnpack").patches + LOWERING_PATCHES)
    torch.manual_seed(0)
    mb = {f: 3 * f * a.hidden * (0.5 + 4 / 128) / 1e6 for f in map(int, a.widths.split(","))}
    made = {f: programs(f, a.hidden, max(2, round(a.bytes / size))) for f, size in mb.items()}
    x = [torch.randn(1, a.hidden), torch.rand(1, 1)]
    us = {f: [] for f in made}
    for _ in range(a.rounds):
        for f, methods in made.items():
            for method, *_ in methods:  # warm: allocate, and leave no weights of these cached
                method.execute(x)
            t = time.perf_counter()
            for _ in range(5):
                for method, *_ in methods:
                    method.execute(x)
            us[f].append((time.perf_counter() - t) / (5 * len(methods)) * 1e6)
    rows = {f: {"mb": round(mb[f], 2), "programs": len(made[f]),
                "us": round(statistics.median(us[f]), 1),
                "gbs": round(mb[f] / statistics.median(us[f]) * 1e3, 1),
                "rounds_us": [round(v, 1) for v in us[f]]} for f in made}
    for f, r in rows.items():
        print(f"F={f}: {r['mb']} MB a call, {r['programs']} programs: {r['us']} us, "
              f"{r['gbs']} GB/s")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
