"""A program in conversation: its tokenizer and chat template, and what its caches hold, so a
sequence that extends the last one prefills only what it adds (chat turns, a server's
conversations). Generation streams text, samples as `sampling.Sampling` says, and stops at the
model's end-of-sequence ids, a stop string, the token budget or the caller's cancel.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import InputError
from ..program import Program
from ..sources.base import load_tokenizer
from .sampling import Sampler, Sampling, StopText


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the caches: not prefilled again
    prefill_s: float = 0.0  # prompt prefilled to first token chosen (time to first token)
    decode_s: float = 0.0


class Session:
    """`Session(target)`: the program of an export folder (or a model.pte), the tokenizer beside
    it (or `tokenizer`), and its chat template when the export shipped one. One sequence at a
    time: callers that share a session take turns (serve.py queues them)."""

    def __init__(self, target: str | Path, tokenizer: str | Path | None = None):
        target = Path(target)
        self.program = Program(target / "model.pte" if target.is_dir() else target)
        folder = Path(tokenizer) if tokenizer else self.program.path.parent
        self.folder = folder if folder.is_dir() else folder.parent
        self.tokenizer = load_tokenizer(folder)
        self.eos = set(self.program.meta.get("get_eos_ids", []))
        self.rewinds = _rewinds(self.program)
        self.fed: list[int] = []  # the ids whose keys, values and states the program holds
        self._chat = None

    @property
    def context(self) -> int | None:
        """Positions a sequence may fill; None for a program with attention sinks (no end)."""
        return None if self.program.sink else self.program.max_context_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat_template(self):
        """transformers' tokenizer for the folder, which holds and renders the chat template
        (read once); InputError when the export shipped none."""
        if self._chat is None:
            self._chat = _chat_tokenizer(self.folder)
        return self._chat

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """`messages` ([{"role", "content"}]) rendered by the model's own chat template, as
        transformers renders it (a sandboxed Jinja environment), ready for the reply."""
        return list(self.chat_template().apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def reset(self) -> None:
        self.fed = []

    def generate(self, ids: list[int], sampling: Sampling = Sampling(),
                 cancelled: Callable[[], bool] = lambda: False) -> "Generation":
        """What the program says after `ids`; iterate it for the text as it grows."""
        problems = sampling.problems()
        if problems:
            raise InputError("; ".join(problems))
        if not ids:
            raise InputError("The prompt is empty after tokenization; give some text.")
        if self.context is not None and len(ids) >= self.context:
            raise InputError(f"The prompt is {len(ids)} tokens; this program holds "
                             f"max_context_len={self.context} positions, and the reply needs "
                             "at least one. Shorten the prompt or export with a larger "
                             "--max-context-len.")
        return Generation(self, list(ids), sampling, cancelled)

    def _reusable(self, ids: list[int]) -> int:
        """How many of `ids` the caches already hold: what they begin with of `self.fed`, all of
        it, or, for a program whose only state is full-length KV caches (a later position is
        written over before it is read), any shared prefix; the last id always runs again, for
        its logits."""
        common = 0
        for a, b in zip(self.fed, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        return common if common == len(self.fed) or self.rewinds else 0


class Generation:
    """Iterate for text pieces; then `finish_reason` ("stop": an end-of-sequence id or a stop
    string; "length": the token budget or the context; "cancelled") and `usage`."""

    def __init__(self, session: Session, ids: list[int], sampling: Sampling, cancelled):
        self.session, self.ids, self.sampling, self.cancelled = session, ids, sampling, cancelled
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.usage = Usage(prompt_tokens=len(ids))

    def __iter__(self) -> Iterator[str]:
        s, ids = self.session, self.ids
        budget = self.sampling.max_tokens
        if s.context is not None:
            budget = min(budget, s.context - len(ids))
        start = s._reusable(ids)
        t0 = time.perf_counter()
        s.fed = []  # until the prefill is through: a failed one leaves no state to trust
        logits = s.program.prefill(ids[start:], start)
        s.fed, self.usage.cached_tokens = list(ids), start
        sampler, stop = Sampler(self.sampling), StopText(self.sampling.stop)
        text, history = _Detokenizer(s.tokenizer), list(ids)
        self.finish_reason = "length"
        for i in range(budget):
            if self.cancelled():
                self.finish_reason = "cancelled"
                break
            tok = sampler(logits[0], history)
            if i == 0:
                self.usage.prefill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
            if tok in s.eos:
                self.finish_reason = "stop"
                break
            self.tokens.append(tok)
            history.append(tok)
            shown = stop.add(text.add(tok))
            if shown:
                self.text += shown
                yield shown
            if stop.stopped:
                self.finish_reason = "stop"
                break
            if i + 1 < budget:
                logits = s.program.forward(torch.tensor([[tok]]), torch.tensor([len(s.fed)]))
                s.fed.append(tok)
        self.usage.decode_s = time.perf_counter() - t0
        self.usage.completion_tokens = len(self.tokens)
        rest = "" if stop.stopped else stop.add(text.rest()) + stop.rest()
        if rest:
            self.text += rest
            yield rest

    def run(self) -> str:
        """The whole text at once."""
        for _ in self:
            pass
        return self.text


class _Detokenizer:
    """Text of the ids so far, a piece per id: each step decodes a few ids, not the whole
    output (decoders whose first token reads differently see a few ids back), and holds back a
    partial character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, tok: int) -> str:
        self.ids.append(tok)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # a whole char
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def rest(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        return self.tokenizer.decode(self.ids[self.prefix:])[len(before):]


def _rewinds(program: Program) -> bool:
    """Whether the program's only state is full-length KV caches (report.json beside it says):
    no ring buffer, conv or recurrent state, which a shorter prefix could not take back."""
    if program.sink:
        return False
    try:
        report = json.loads((program.path.parent / "report.json").read_text())
        state, kv = report["state"]["layers"], report["kv_cache"]["layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # nothing says so: reuse only what extends the caches
    return len(state) == len(kv) and all(row["window"] is None for row in kv)


def _chat_tokenizer(folder: Path):
    """transformers' tokenizer for the folder, which renders its chat template; InputError
    when the export shipped none (its source had none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise InputError(f"Cannot read the tokenizer in {folder} for its chat template ({e}).")
    if not tokenizer.chat_template:
        raise InputError(f"{folder} has no chat template (the model it was exported from had "
                         "none in tokenizer_config.json, chat_template.jinja or its GGUF): "
                         "use `edgellm generate` with a plain prompt.")
    return tokenizer


def generate(pte, prompt: str, n: int = 32, tokenizer=None, on_text=None, chat: bool = False,
             **sampling) -> str:
    """edgellm.generate: one prompt, one completion."""
    session = Session(pte, tokenizer)
    ids = session.chat_ids([{"role": "user", "content": prompt}]) if chat else \
        session.encode(prompt)
    run = session.generate(ids, Sampling.of(max_tokens=n, **sampling))
    for piece in run:
        if on_text:
            on_text(piece)
    return run.text
