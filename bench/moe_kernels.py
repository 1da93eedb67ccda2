"""One mixture-of-experts layer's call, by formulation, at LFM2-8B-A1B's shape by default (32
experts of 1792 over a hidden size of 2048, 4 chosen): ExecuTorch's `llama::quantized_moe_ffn`
with 4-bit experts (the kernel an 8da4w program runs), the float experts gathered per token
(edgellm's formulation without a recipe), and the floor: the chosen experts' packed bytes at the
measured bandwidth. Decode (1 token) and a prompt chunk. Best of 5 calls each; the op is the same
C++ kernel the runtime runs (its ATen registration).

`--every-expert` adds the formulation XNNPACK can delegate whole: every expert computed, as two
8da4w linears (D -> E x 2F for gate and up, E x F -> D for down, the hidden scaled by the routing
weights, zero for the experts not chosen: the same sum), lowered to XNNPACK and run by
ExecuTorch's runtime. It reads all E experts where the op reads k.

`--chosen` adds `--experts chosen`: the block as the program runs it (edgellm's own lowering,
lower.lower_experts then lower.lower): routing, then per expert a torch.cond on whether a token
chose it around that expert's 8da4w XNNPACK delegate. It reads the chosen experts only.

usage: python bench/moe_kernels.py [--shape 32,4,2048,1792] [--tokens 1,4] [--threads 2]
    [--group 32] [--every-expert] [--chosen]
"""

import argparse
import json

from sdpa_kernels import best_ms  # sets OMP_NUM_THREADS=1 before torch loads; --threads sets it

import torch  # noqa: E402

from edgellm.architectures.moe import Routing, SparseMoE  # noqa: E402
from edgellm.quantize.experts import pack_experts  # noqa: E402


def bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_ms(lambda: dst.copy_(src)) / 1e6


class EveryExpert(torch.nn.Module):
    """The block's experts as two linears; routing weights (N, E) given, zero where not chosen."""

    def __init__(self, block: SparseMoE):
        super().__init__()
        e, f, d = block.routing.experts, block.width, block.hidden
        self.e, self.f = e, f
        self.up = torch.nn.Linear(d, e * 2 * f, bias=False)
        self.down = torch.nn.Linear(e * f, d, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(block.experts.gate_up_proj.reshape(e * 2 * f, d))
            self.down.weight.copy_(block.experts.down_proj.permute(1, 0, 2).reshape(d, e * f))

    def forward(self, x, weights):
        h = self.up(x).view(-1, self.e, 2 * self.f)
        gate, lin = h.split(self.f, dim=-1)
        h = torch.nn.functional.silu(gate) * lin * weights.unsqueeze(-1)
        return self.down(h.reshape(-1, self.e * self.f))


def every_expert_ms(block: SparseMoE, xs: dict, group: int) -> dict:
    """{tokens: ms} of EveryExpert, 8da4w, lowered to XNNPACK, through ExecuTorch's runtime."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torchao.quantization import quantize_

    from edgellm.quantize.recipes import torchao_config

    module = EveryExpert(block).eval()
    quantize_(module, torchao_config(4, group, dynamic=True))
    out = {}
    for n, x in xs.items():
        weights = torch.zeros(n, block.routing.experts)
        weights[:, :block.routing.top_k] = 1.0 / block.routing.top_k
        ep = torch.export.export(module, (x, weights))
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        buffer = program.to_executorch().buffer  # the runtime reads it in place: kept alive
        loaded = Runtime.get().load_program(buffer)
        method = loaded.load_method("forward")
        out[n] = best_ms(lambda: method.execute([x, weights]))
    return out


def chosen_ms(block: SparseMoE, xs: dict, group: int) -> dict:
    """{tokens: ms} of the block with `--experts chosen`, 8da4w, through ExecuTorch's runtime."""
    import copy

    from executorch.runtime import Runtime

    from edgellm import patches
    from edgellm.backends import get_backend
    from edgellm.lower import LOWERING_PATCHES, lower, lower_experts
    from edgellm.quantize.experts import quantize_experts

    xnnpack = get_backend("xnnpack")
    patches.apply(xnnpack.patches + LOWERING_PATCHES)
    block = copy.deepcopy(block)
    quantize_experts(block, 4, group, "chosen")
    lower_experts(block, lambda: xnnpack.make_partitioners(xnnpack.options()), max(xs))
    out = {}
    for n, x in xs.items():
        ep = torch.export.export(block, (x,), strict=False)
        program = lower({"forward": ep}, xnnpack.make_partitioners(xnnpack.options()), {},
                        etrecord=False).program
        method = Runtime.get().load_program(program.buffer).load_method("forward")
        out[n] = best_ms(lambda: method.execute([x]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="32,4,2048,1792", help="experts, chosen, hidden, width")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--every-expert", action="store_true")
    p.add_argument("--chosen", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    e, k, d, f = map(int, a.shape.split(","))
    block = SparseMoE(Routing("sigmoid", e, k, True, bias=True), d, f).eval()
    with torch.no_grad():
        for t in block.parameters():
            t.copy_(torch.randn(t.shape) * 0.02)
        gathered = {}
        xs = {n: torch.randn(n, d) for n in map(int, a.tokens.split(","))}
        for n, x in xs.items():
            gathered[n] = best_ms(lambda: block(x))
        every = every_expert_ms(block, xs, a.group) if a.every_expert else {}
        chosen = chosen_ms(block, xs, a.group) if a.chosen else {}
        block.use_packed(pack_experts(block.experts.gate_up_proj, 4, a.group),
                         pack_experts(block.experts.down_proj, 4, a.group), 4, a.group)
        read = (block.packed_w13.nbytes + block.packed_w2.nbytes) * k // e
        gbs = bandwidth_gbs()
        rows = []
        for n, x in xs.items():
            op = best_ms(lambda: block(x))
            rows.append({"tokens": n, "op_4bit_ms": round(op, 2),
                         "gathered_fp32_ms": round(gathered[n], 2),
                         "every_expert_8da4w_xnnpack_ms": every.get(n) and round(every[n], 2),
                         "chosen_8da4w_xnnpack_ms": chosen.get(n) and round(chosen[n], 3),
                         "floor_ms_decode": round(read / gbs / 1e6, 3)})
            print(f"{n:4d} tokens: op 4-bit {op:8.2f} ms   float gathered {gathered[n]:8.2f} ms   "
                  + (f"every expert 8da4w XNNPACK {every[n]:8.2f} ms   " if every else "")
                  + (f"chosen, 8da4w XNNPACK {chosen[n]:8.3f} ms   " if chosen else "")
                  + f"floor (chosen experts' 4-bit bytes, one token) {read / gbs / 1e6:.3f} ms")
    print(json.dumps({"shape": [e, k, d, f], "group": a.group, "threads": a.threads,
                      "bandwidth_gbs": round(gbs, 1), "rows": rows}))


if __name__ == "__main__":
    main()
