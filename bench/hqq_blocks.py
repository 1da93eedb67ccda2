"""torchao's HQQ scale search, upstream (whole weight per pass) against edgellm's patch
(`torchao.hqq_in_blocks`), on weight shapes of a real model; checks the results are equal.

usage: python bench/hqq_blocks.py [--shapes 5120x3072 3072x3072 16384x3072 3072x8192]
                                  [--blocks-kb 256 1024 2048 4096] [--group 128] [--grad]

Default shapes: Phi-4-mini's four linears (q/k/v fused, o, gate/up fused, down), N(0, 0.02)
weights. `--grad` runs with weights that require grad, as edgellm's quantize stage did before it
ran under `torch.no_grad`. Prints seconds per shape and per layer, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["5120x3072", "3072x3072", "16384x3072",
                                                   "3072x8192"])
    p.add_argument("--blocks-kb", nargs="+", type=int, default=[256, 1024, 2048, 4096])
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--grad", action="store_true")
    a = p.parse_args(argv)
    from edgellm.patches import torchao as patch

    torch.manual_seed(0)
    weights = [(torch.randn(*map(int, s.split("x"))) * 0.02).requires_grad_(a.grad)
               for s in a.shapes]
    row, upstream = {}, []
    runs = [("upstream", None)] + [(f"blocks_{kb}kb", kb) for kb in a.blocks_kb]
    for name, kb in runs:
        total, out = 0.0, []
        for w in weights:
            t0 = time.perf_counter()
            if kb is None:
                out.append(patch._UPSTREAM(w, [1, a.group], -8, 7))
            else:
                patch.BLOCK_BYTES = kb << 10
                got = patch.hqq_in_blocks(w, [1, a.group], -8, 7)
                ref = upstream[len(out)]
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), name
                out.append(got)
            total += time.perf_counter() - t0
        if kb is None:
            upstream = out
        row[name] = round(total, 2)
        print(f"{name:<16} {total:7.2f} s per layer", flush=True)
    print(json.dumps(dict(shapes=a.shapes, group=a.group, grad=a.grad, seconds=row)))


if __name__ == "__main__":
    main()
