"""How the next token is chosen, for every entry point (generate, chat, serve): greedy at
temperature 0 (the default), else sampled after transformers' own logits processors, in the
order its `generate` applies them (repetition penalty, temperature, top-k, top-p, min-p); and
stop strings, which end the text where one begins. Importing it imports no torch (the CLI
builds its flags from `Sampling` before openmp.py sets the environment torch reads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


GREEDY_BELOW = 1e-30  # logits of up to 1e8 over it stay below float32's largest, 3.4e38


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 32

    def problems(self) -> list[str]:
        """Every value out of range, each naming what is allowed."""
        out, checks = [], [
            ("temperature", self.temperature >= 0, "a number >= 0 (0: greedy)"),
            ("top_k", self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("top_p", 0 < self.top_p <= 1, "a number in (0, 1] (1: off)"),
            ("min_p", 0 <= self.min_p <= 1, "a number in [0, 1] (0: off)"),
            ("repetition_penalty", self.repetition_penalty > 0, "a number > 0 (1: off)"),
            ("max_tokens", self.max_tokens >= 1, "an integer >= 1")]
        for name, ok, allowed in checks:
            if not ok:
                out.append(f"{name}: {getattr(self, name)} is out of range; give {allowed}")
        if any(not s for s in self.stop):
            out.append("stop: an empty stop string would end every text at once")
        return out

    @classmethod
    def of(cls, **options) -> "Sampling":
        """From keyword options (edgellm.generate's, chat's): an unknown one refused by name, a
        single stop string taken as one."""
        from ..errors import InputError

        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InputError(f"unknown sampling option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        stop = options.get("stop", ())
        options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        return cls(**options)


HELP = {  # each field's meaning, for the CLI's flags (generate, chat)
    "temperature": "sampling temperature (default 0: greedy)",
    "top_k": "sample among the k likeliest tokens (default 0: off)",
    "top_p": "sample among the likeliest tokens whose probabilities sum to p (default 1: off)",
    "min_p": "drop tokens below min_p times the likeliest's probability (default 0: off)",
    "repetition_penalty": "divide the logits of tokens already seen by this (default 1: off)",
    "seed": "seed of the sampler (default: a different draw each run)",
    "stop": "a string that ends the text, not included (repeat the flag for more)",
    "max_tokens": "tokens to generate at most"}


class Sampler:
    """`Sampler(sampling)(logits[V], history) -> token id`; `history` is every id the model has
    seen in this sequence (the repetition penalty's). One generator per sampler: a seed gives
    the same tokens for the same logits."""

    def __init__(self, sampling: Sampling):
        from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                            RepetitionPenaltyLogitsProcessor,
                                                            TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)

        s = self.sampling = sampling
        # a temperature under GREEDY_BELOW would overflow float32 logits (or be 0 in float32):
        # its limit, greedy
        self.greedy = s.temperature < GREEDY_BELOW
        steps = []
        if s.repetition_penalty != 1:
            steps.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if not self.greedy:
            if s.temperature != 1:
                steps.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k:
                steps.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1:
                steps.append(TopPLogitsWarper(s.top_p))
            if s.min_p:
                steps.append(MinPLogitsWarper(s.min_p))
        import torch

        self.steps = LogitsProcessorList(steps)
        self.generator = torch.Generator()
        if s.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(s.seed)

    def __call__(self, logits, history: list[int]) -> int:
        import torch

        scores = logits.reshape(1, -1).float()  # (1, V)
        if self.steps:
            scores = self.steps(torch.tensor([history], dtype=torch.long), scores)
        if self.greedy:
            return int(scores[0].argmax())
        probs = torch.softmax(scores[0], dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopText:
    """Text as it grows, held back where it might be the start of a stop string: `add(piece)`
    returns the text now safe to show; `stopped` once a stop string appeared (the text ends
    before it); `rest()` what was held back when the tokens ran out."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.text, self.shown, self.stopped = stop, "", 0, False

    def add(self, piece: str) -> str:
        self.text += piece
        cut = min((i for i in (self.text.find(s, max(0, self.shown - len(s) + 1))
                               for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._show(cut)
        held = max((k for s in self.stop for k in range(1, len(s))
                    if self.text.endswith(s[:k])), default=0)
        return self._show(len(self.text) - held)

    def rest(self) -> str:
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        out, self.shown = self.text[self.shown:upto], max(self.shown, upto)
        return out
