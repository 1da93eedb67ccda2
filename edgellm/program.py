"""A .pte through the ExecuTorch runtime behind the same interface as the eager model:
`forward(tokens[1, T], input_pos[1]) -> logits[1, V]`, plus a bare greedy decode loop (no
tokenizer, nothing kept per token). Verification and the run side (run/) both run programs
through it; generation with sampling and a tokenizer is run/session.py's."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

from .errors import InputError
from .layout import FOUNDATION
from .memory import libc

QUIET_NATIVE_LOGS = False  # set by the CLI: the runtime's C++ info lines go to /dev/null


_SILENCING = [0]  # depth of nested native_logs() blocks; only the outermost redirects


@contextlib.contextmanager
def native_logs():
    """ExecuTorch's kernels log on stderr from C++ on every call ("No temp allocator provided");
    with QUIET_NATIVE_LOGS they are discarded. Python exceptions still carry the errors. Cheap
    inside an outer block (a decode loop wrapped once costs two dup2 calls, not two per token)."""
    if not QUIET_NATIVE_LOGS or _SILENCING[0]:
        _SILENCING[0] += 1
        try:
            yield
        finally:
            _SILENCING[0] -= 1
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    _SILENCING[0] += 1
    try:
        yield
    finally:
        _SILENCING[0] -= 1
        libc().fflush(None)  # C stdio buffers what the kernels logged; drop it with the rest
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


METADATA = ("get_max_seq_len", "get_max_context_len", "get_vocab_size", "get_n_layers",
            "get_bos_id", "get_eos_ids", "use_kv_cache", "enable_dynamic_shape",
            "get_attention_sink")


class Program:
    """A loaded program. Custom LLM ops and quantized kernels are registered before loading."""

    def __init__(self, path: str | Path):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama:: kernels
        import executorch.kernels.quantized  # noqa: F401  quantized_decomposed:: kernels
        from executorch.runtime import Runtime

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"Program {self.path} does not exist. Export one with "
                             "`edgellm export -o OUT` and pass OUT/model.pte.")
        data = self.path.with_name(f"{FOUNDATION}.ptd")
        self.data = data if data.is_file() else None
        try:
            with native_logs():
                self.program = Runtime.get().load_program(
                    str(self.path), data_path=str(self.data) if self.data else None)
                self._forward = self.program.load_method("forward")
        except (RuntimeError, ValueError) as e:
            raise InputError(self._unloadable(e)) from None
        names = self.program.method_names
        self.meta = {m: self._constant(m) for m in METADATA if m in names}
        self._prefill = self.chunk = None
        if "prefill" in names:  # T fixed at a chunk length; shares forward's buffers
            with native_logs():
                self._prefill = self.program.load_method("prefill")
            self.chunk = int(self._prefill.metadata.input_tensor_meta(0).sizes()[1])

    def _unloadable(self, e: Exception) -> str:
        why = f"Cannot load {self.path} with this machine's ExecuTorch runtime ({e})."
        if self.data is not None:
            return (f"{why} Its weights file {self.data} may be damaged or another program's: "
                    "export both files again, together.")
        return (f"{why} A program exported with --external-weights needs its {FOUNDATION}.ptd "
                "beside it, and there is none; programs delegated to Core ML or Vulkan build on "
                "Linux but run only on their devices.")

    def _constant(self, name: str):
        with native_logs():
            out = self.program.load_method(name).execute([])
        return list(out) if name in ("get_eos_ids", "get_attention_sink") else out[0]

    @property
    def max_seq_len(self) -> int:
        return int(self.meta["get_max_seq_len"])

    @property
    def max_context_len(self) -> int:
        return int(self.meta.get("get_max_context_len", self.max_seq_len))

    @property
    def sink(self) -> list[int] | None:
        """[sink, window] of a program with attention sinks, which takes any position."""
        return self.meta.get("get_attention_sink")

    @property
    def dynamic(self) -> bool:
        return bool(self.meta.get("enable_dynamic_shape", False))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        start, T = int(input_pos[0]), tokens.shape[1]
        past = start + T > self.max_context_len and not self.sink
        if start < 0 or past or T > self.max_seq_len:
            raise InputError(f"Cannot run positions {start}..{start + T - 1}: this program takes "
                             f"at most {self.max_seq_len} tokens per call within "
                             f"max_context_len {self.max_context_len}.")
        with native_logs():
            return self._forward.execute([tokens, input_pos])[0]

    def prefill(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """Logits after `ids`: whole chunks through `prefill` when the program has it, the rest
        through `forward`, in one call when its T is dynamic, else one token per call."""
        i, logits = 0, None
        if self._prefill is not None:
            while len(ids) - i >= self.chunk and (self.sink or start + i + self.chunk <=
                                                  self.max_context_len):
                chunk = torch.tensor([ids[i:i + self.chunk]], dtype=torch.long)
                with native_logs():
                    logits = self._prefill.execute([chunk, torch.tensor([start + i])])[0]
                i += self.chunk
        step = self.max_seq_len if self.dynamic else 1
        for j in range(i, len(ids), step):
            chunk = torch.tensor([ids[j:j + step]], dtype=torch.long)
            logits = self.forward(chunk, torch.tensor([start + j], dtype=torch.long))
        return logits


def greedy(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
           prefill: Callable[[list[int]], torch.Tensor], ids: list[int], n: int,
           eos: set[int]) -> Iterator[int]:
    """Yield up to `n` greedy tokens after prompt `ids`, stopping after an end-of-sequence token."""
    logits = prefill(ids)
    pos = len(ids)
    for _ in range(n):
        tok = int(logits[0].argmax())
        yield tok
        if tok in eos:
            return
        logits = step(torch.tensor([[tok]], dtype=torch.long), torch.tensor([pos]))
        pos += 1
