"""torch.export of the program's methods: `forward(tokens[1, T], input_pos[1]) -> logits[1, V]`.

T is dynamic (1..max_seq_len) when every backend in the chain takes dynamic shapes, else fixed at 1.
`prefill` is the same module exported with T fixed at a chunk length: both methods write the
same buffers, which the lowering plans at the same place for both (share_mutable_buffers).
"""

from __future__ import annotations

import torch
from torch.export import Dim, ExportedProgram


def example_inputs(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, seq_len, dtype=torch.long), torch.tensor([0], dtype=torch.long)


def export_forward(model: torch.nn.Module, max_seq_len: int, dynamic: bool) -> ExportedProgram:
    if dynamic and max_seq_len > 1:
        tokens_dim = Dim("T", min=1, max=max_seq_len)
        shapes = {"tokens": {1: tokens_dim}, "input_pos": None}
        args = example_inputs(min(2, max_seq_len))
    else:
        shapes, args = None, example_inputs(1)
    with torch.no_grad():
        return torch.export.export(model, args, dynamic_shapes=shapes, strict=False)


def export_methods(model: torch.nn.Module, max_seq_len: int, dynamic: bool,
                   prefill_chunk: int) -> dict[str, ExportedProgram]:
    # inference weights: no tensor of the program asks for gradients (a retrace that meets a
    # torch.cond with inputs that do traces its branches again for autograd's sake)
    model.requires_grad_(False)
    programs = {"forward": export_forward(model, max_seq_len, dynamic)}
    if prefill_chunk:
        with torch.no_grad():
            programs["prefill"] = torch.export.export(model, example_inputs(prefill_chunk),
                                                      strict=False)
    return programs
