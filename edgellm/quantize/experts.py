"""Mixture-of-experts weights for ExecuTorch's `llama::quantized_moe_ffn`: each expert's matrices
quantized symmetrically per group (torchao's `choose_qparams_affine` / `quantize_affine`, as
ExecuTorch's own transform, examples/models/llama/source_transformation/moe.py, does) and packed
in torchao's "universal" layout for 8-bit-activation linears, stacked (E, bytes).

The packing is torchao's `_pack_8bit_act_{4,8}bit_weight(..., "universal")` written in torch ops:
that op lives in torchao's CPU kernel library, which the x86 pip wheel does not ship. Layout
(torchao csrc/cpu: packed_weights_header.h, linear_8bit_act_xbit_weight/packed_weights_format.h,
weight_packing/weight_packing.h, fallback/bitpacking/uint4.h, torchao 0.18):
- a 64-byte header, int32 {6712, 1 (universal), nbit, has_zeros 0, has_bias 0, nr 8, kr 16,
  sr 2, 0...};
- rows padded to a multiple of nr = 8; per panel of 8 rows and per group: each 16-wide chunk of
  the group as the 8 rows' first 8 values, then their last 8 (sr = 2); then the 8 rows' float32
  scales, then their int32 sums of the group's values;
- 8-bit values as they are; 4-bit ones as q + 8, two per byte: in each run of 32, byte i holds
  value i in its low nibble and value i + 16 in its high one.
tests/test_moe.py checks the blobs through the op itself, and that a wrong layout fails.
"""

from __future__ import annotations

import torch

NR, KR, SR = 8, 16, 2
HEADER = (6712, 1)  # torchao's PackedWeightsHeader magic, linear_8bit_act_xbit_weight_universal


def symmetric(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> int8 values (N, K) in [-2^(bits-1), 2^(bits-1)-1] and fp32 scales (N, K/group),
    torchao's symmetric per-group scheme."""
    from torchao.quantization.quant_primitives import (
        MappingType, choose_qparams_affine, quantize_affine)

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    block = (1, group)
    scale, zero = choose_qparams_affine(w.float(), MappingType.SYMMETRIC, block,
                                        target_dtype=torch.int8, quant_min=lo, quant_max=hi)
    q = quantize_affine(w.float(), block, scale, zero, output_dtype=torch.int8, quant_min=lo,
                        quant_max=hi)
    return q, scale.reshape(w.shape[0], -1).float()


def pack(q: torch.Tensor, scales: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """int8 values (N, K) and fp32 scales (N, K/group) -> the universal blob, uint8 (bytes,)."""
    n, k = q.shape
    g, c, p = k // group, group // KR, -(-n // NR)
    s = scales.reshape(n, g)
    if p * NR != n:  # padding rows: value 0, scale 0
        q = torch.cat([q, q.new_zeros(p * NR - n, k)])
        s = torch.cat([s, s.new_zeros(p * NR - n, g)])
    # (P, row, G, chunk, half, 8) -> (P, G, chunk, half, row, 8): per chunk, each row's halves
    v = q.view(p, NR, g, c, SR, KR // SR).permute(0, 2, 3, 4, 1, 5).reshape(p, g, c, NR * KR)
    if bits == 8:
        values = v.contiguous().view(torch.uint8).reshape(p, g, c * NR * KR)
    else:
        u = (v.to(torch.int16) + 8).to(torch.uint8).view(p, g, c, 4, 2, 16)
        values = ((u[..., 1, :] << 4) | u[..., 0, :]).reshape(p, g, c * 64)
    scale_bytes = s.view(p, NR, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # (P, G, 32)
    sums = q.view(p, NR, g, group).sum(-1, dtype=torch.int32).permute(0, 2, 1).contiguous()
    body = torch.cat([values, scale_bytes, sums.view(torch.uint8)], dim=-1).reshape(-1)
    header = torch.tensor([*HEADER, bits, 0, 0, NR, KR, SR] + [0] * 8, dtype=torch.int32)
    return torch.cat([header.view(torch.uint8), body])


def pack_experts(weights, bits: int, group: int) -> torch.Tensor:
    """Stacked expert matrices (E, N, K), or their (N, K) one at a time (moe.Experts.rows), ->
    (E, bytes) uint8, one blob per expert."""
    return torch.stack([pack(*symmetric(w, bits, group), group, bits) for w in weights])


def quantize_experts(model, bits: int, group: int, formulation: str = "op",
                     dynamic: bool = True, later: bool = False) -> tuple[int, int]:
    """Every sparse block's experts quantized, one block at a time: "op", packed for
    `llama::quantized_moe_ffn` (SparseMoE.use_packed); "every", as the two linears of
    `moe.every_expert_linears`, quantized by torchao as the recipe's linears are
    (SparseMoE.use_linears); "chosen", as an `moe.Expert` apiece, quantized the same way
    (SparseMoE.use_each; lower.lower_experts makes each a delegate; with `later`, left for it
    to quantize, `quantize_block`, as it lowers the block: SparseMoE.pending). Experts still in
    the checkpoint (moe.Deferred) are read as they are quantized (an expert at a time), and the
    checkpoint pages read for them handed back after each block. Returns (blocks, bytes a
    decode step saves: the float bytes of the experts a token reads less their quantized
    ones)."""
    from ..architectures.moe import SparseMoE
    from ..memory import drop_checkpoint_pages

    def chosen(block):  # bytes of the experts a token reads
        experts, share = block.expert_tensors()
        return int(sum(t.nbytes for t in experts) * share)

    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    saved = 0
    for block in blocks:
        before, experts = chosen(block), block.experts
        if formulation == "every":
            saved += before - _as_linears(block, bits, group, dynamic)
        elif formulation == "chosen" and later:
            block.pending = (bits, group, dynamic)
            saved += before - _chosen_bytes(block, bits, group)
            continue
        elif formulation == "chosen":
            saved += before - _as_each(block, bits, group, dynamic)
        else:
            w13 = pack_experts(experts.rows("gate_up_proj"), bits, group)
            w2 = pack_experts(experts.rows("down_proj"), bits, group)
            block.use_packed(w13, w2, bits, group)
            saved += before - chosen(block)
        if experts.deferred:
            drop_checkpoint_pages()
    return len(blocks), saved


def _as_linears(block, bits: int, group: int, dynamic: bool) -> int:
    """The block's experts as two linears quantized with torchao; returns their bytes."""
    from torchao.quantization import quantize_

    from ..architectures.moe import every_expert_linears
    from .grid import packed_bytes
    from .recipes import torchao_config

    up, down = every_expert_linears(block)
    size = packed_bytes(up.weight, bits, group) + packed_bytes(down.weight, bits, group)
    block.use_linears(up, down)
    quantize_(block, torchao_config(bits, group, dynamic),
              filter_fn=lambda m, fqn: m is up or m is down)
    return size


def _as_each(block, bits: int, group: int, dynamic: bool) -> int:
    """The block's experts as an `moe.Expert` apiece, read and quantized with torchao one at a
    time; returns the bytes a token reads of them (k of E)."""
    from torch import nn
    from torchao.quantization import quantize_

    from ..architectures.moe import Expert
    from .recipes import torchao_config

    each = []
    for gate_up, down in zip(block.experts.rows("gate_up_proj"), block.experts.rows("down_proj")):
        expert = Expert.of(gate_up, down)
        quantize_(expert, torchao_config(bits, group, dynamic))
        each.append(expert)
    size = _chosen_bytes(block, bits, group)
    block.use_each(nn.ModuleList(each))
    return size


def _chosen_bytes(block, bits: int, group: int) -> int:
    """Bytes a token reads of the block's experts quantized one apiece (k of E)."""
    from .grid import packed_bytes

    f, d = block.width, block.hidden
    one = 2 * packed_bytes(torch.empty(f, d, device="meta"), bits, group) + packed_bytes(
        torch.empty(d, f, device="meta"), bits, group)
    return one * block.routing.top_k


def quantize_block(block) -> None:
    """A block `quantize_experts(..., later=True)` left (SparseMoE.pending) quantized now."""
    from ..memory import drop_checkpoint_pages

    deferred = bool(block.experts.deferred)
    _as_each(block, *block.pending)
    block.pending = None
    if deferred:
        drop_checkpoint_pages()
