"""Checking an exported program against the model it came from: two levels, and what a recipe
costs.

- rewrite: edgellm's eager model (written for the backend) against transformers on the same
  weights, both in float32: the re-authoring changed no math.
- program: the `.pte` through the ExecuTorch runtime against edgellm's eager model built exactly as
  the program was (dtype, quantization): the lowering changed no math. Programs this machine cannot
  run (Core ML, Vulkan) are checked one step earlier, as the exported graph (`torch.export`
  output) before any delegate, and the report says that the delegate itself did not run.
- quantization (quantized programs): the program (or the exported graph, for programs that cannot
  run here) against transformers in fp32, within the recipe's stated bounds: what the recipe
  costs in accuracy. Measured along the shipped text when the export has a tokenizer (below),
  else on the prompts.

Beside the checks, when the export has a tokenizer, the perplexity of transformers in fp32 and of
the program (or exported graph) on a short English text shipped in `edgellm/data`, fed one token
at a time from position 0 (up to 128 tokens, clipped to the cache), and how often the two agree
on the next token along that text (reported, not enforced).

Every check feeds the same tokens to both sides (the reference's greedy continuation), over a
prompt and `steps` tokens (pieces of the shipped text when the export has a tokenizer, else
pseudo-random ids), starting each prompt at position 0 (which resets the state): the program
(or graph) takes a prefill and then a token per call, as a runner does; edgellm's eager model
takes each sequence in calls of max_seq_len tokens that return every position's logits (the
same causal math, without a pass over every weight per token); transformers recomputes the
sequence. It reports max absolute and relative error, SQNR, top-1 agreement and the first step
whose greedy token differs. Thresholds depend on dtype and quantization.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .architectures.cache import float_caches
from .errors import InputError, VerificationError
from .numerics import compare

# (minimum SQNR dB, minimum top-1 agreement) per what is compared; an fp32 check's are lowered
# to what the model's own rounding sensitivity allows (`rounding_limits`), an fp16 or bf16
# program's SQNR follows what rounding to its dtype costs the model either way (`dtype_limits`),
# a quantized program's what its activations' rounding costs it, either way (`activation_limits`)
THRESHOLDS = {"fp32": (60.0, 1.0), "fp16": (30.0, 0.9), "bf16": (20.0, 0.8),
              "quantized": (20.0, 0.8)}
# fp32's unit roundoff: a correct kernel rounds each output once to it
FP32_UNIT_ROUNDOFF = 2.0 ** -24
# how far below the model's sensitivity to rounding a correct program may land
ROUNDING_MARGIN_DB = 10.0
# how far below the model's sensitivity to its activations' rounding a correct quantized program
# may land: its kernels round each activation once more, their own way (twice the error power,
# 3 dB), and an estimate over a few hundred rows varies by as much again (the real SmolLM2's
# seven programs: from 2.7 dB below their sensitivity to 4.3 above: BENCHMARKS.md)
ACTIVATION_MARGIN_DB = 6.0
PROMPT_LENGTHS = (5, 11)


@dataclass(frozen=True)
class Check:
    level: str  # "rewrite", "program", "exported graph" or "quantization"
    passed: bool
    min_sqnr_db: float
    min_top1: float
    max_abs: float
    max_rel: float  # max_abs / max |reference logit|
    sqnr_db: float
    top1: float
    first_divergence: str | None  # "prompt i step j" or "text step j": the first greedy token
    # that differs
    note: str = ""
    # the quantization check along the shipped text: its perplexity over fp32's, and the bound
    perplexity_ratio: float | None = None
    max_perplexity_ratio: float | None = None


def prompts(vocab: int, longest: int, text: list[int] | None = None,
            seed: int = 0) -> list[list[int]]:
    """Fixed prompts of PROMPT_LENGTHS tokens (at most `longest`): pieces of the shipped text when
    there is a tokenizer (a real model's logits on random ids are flat, so a tiny error flips
    their argmax), else pseudo-random token ids."""
    lengths = sorted({max(1, min(n, longest)) for n in PROMPT_LENGTHS})
    if text and len(text) >= 2 * max(lengths):
        return [text[i * max(lengths):i * max(lengths) + n] for i, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def reference_run(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by transformers, recomputing the whole sequence each step, and the
    logits after the prompt and after each generated token but the last: (steps, vocab), which the
    last step's full-sequence call already holds."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):], logits[len(prompt) - 1:].float()


def run_steps(forward, prefill, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits after the prompt and after each of `tokens` but the last: (steps, vocab)."""
    out = [prefill(prompt)[0]]
    for i, tok in enumerate(tokens[:-1]):
        out.append(forward(torch.tensor([[tok]]), torch.tensor([len(prompt) + i]))[0])
    return torch.stack([o.float() for o in out])


def sequence_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """An eager model's logits at every position of `ids` from position 0, (len(ids), vocab), in
    calls of at most `chunk` tokens (the longest one call takes)."""
    from .architectures.layers import every_position

    with every_position(model):
        return torch.cat([model(torch.tensor([ids[i:i + chunk]]), torch.tensor([i]))[0]
                          for i in range(0, len(ids), chunk)]).float()


def eager_prefill(model):
    """Prefill for an eager model or exported graph: the whole prompt in one call."""
    return lambda ids: model(torch.tensor([ids]), torch.tensor([0]))


def measure(level: str, actual: list, expected: list, limits: tuple, note: str = "",
            text_last: bool = False) -> Check:
    """`actual` against `expected` (lists of (steps, vocab) logits: the prompts', and with
    `text_last` the shipped text's last) within `limits` (minimum SQNR, minimum top-1)."""
    c = compare(torch.cat(actual), torch.cat(expected))
    divergence = None
    for i, (a, e) in enumerate(zip(actual, expected)):
        step = next((j for j, (x, y) in enumerate(zip(a.argmax(-1), e.argmax(-1))) if x != y),
                    None)
        if step is not None:
            divergence = ("text" if text_last and i == len(actual) - 1 else f"prompt {i}") + \
                f" step {step}"
            break
    peak = float(torch.cat(expected).abs().max()) or 1.0
    passed = c.sqnr_db >= limits[0] and c.argmax_agree >= limits[1]
    return Check(level, passed, limits[0], limits[1], c.max_abs, c.max_abs / peak, c.sqnr_db,
                 c.argmax_agree, divergence, note)


def rounding_limits(model, collect, clean: list) -> tuple[tuple, str]:
    """The (minimum SQNR, minimum top-1) a correct fp32 program of `model` meets, and a note:
    `model`'s logits (`collect(model)`) with every linear's output off by the rounding a correct
    fp32 kernel makes (relative, one unit roundoff, random, seeded) against its `clean` logits
    measure how much this model's own scale (large activations, outlier channels, depth)
    amplifies that rounding; a correct program may land ROUNDING_MARGIN_DB below it and flip
    twice the argmaxes it flips. Never above THRESHOLDS["fp32"]. (Half-precision programs round
    weights, norms and every op, more than this models: `dtype_limits`.)"""
    from torch import nn

    generator, unit = torch.Generator().manual_seed(0), FP32_UNIT_ROUNDOFF

    def rounded(module, inputs, out):
        noise = torch.randn(out.shape, generator=generator).to(out.dtype)
        return out + out * (unit * noise)

    hooks = [m.register_forward_hook(rounded) for m in model.modules()
             if isinstance(m, nn.Linear)]
    try:
        noisy = collect(model)
    finally:
        for hook in hooks:
            hook.remove()
    return sensitivity_limits(compare(torch.cat(noisy), torch.cat(clean)), THRESHOLDS["fp32"],
                              ROUNDING_MARGIN_DB, "fp32 rounding", "every linear off by it")


def dtype_limits(c, dtype: str) -> tuple[tuple, str]:
    """The (minimum SQNR, minimum top-1) a correct fp16 or bf16 program meets against its model
    run eagerly in `dtype`, and a note. `c` (numerics.compare of that eager model's logits
    against its fp32 ones) is what rounding every op to `dtype` costs this model; a correct
    program rounds as often, its own way (its kernels fuse, order and accumulate otherwise), so
    it lands within ROUNDING_MARGIN_DB below `c` and flips at most twice its argmaxes. The SQNR
    bound goes both ways, up to fp32's (a fixed 20 dB passed a bf16 program with one value
    projection 10% off, at 26.9 dB: BENCHMARKS.md), the top-1 one never above THRESHOLDS[dtype]."""
    return sensitivity_limits(c, THRESHOLDS[dtype], ROUNDING_MARGIN_DB, f"{dtype} rounding",
                              f"the model in {dtype}", ceiling_db=THRESHOLDS["fp32"][0])


def sensitivity_limits(c, cap: tuple, margin_db: float, to: str, how: str,
                       ceiling_db: float | None = None) -> tuple[tuple, str]:
    """Bounds `margin_db` below a measured sensitivity `c` (a numerics.compare) and twice its
    argmax flips, never above `cap` (the SQNR bound, given a `ceiling_db`, never above that
    instead); the note says so when they are below `cap`."""
    limits = (min(cap[0] if ceiling_db is None else ceiling_db, round(c.sqnr_db - margin_db, 1)),
              min(cap[1], round(2 * c.argmax_agree - 1, 3)))
    note = "" if limits[0] >= cap[0] and limits[1] >= cap[1] else (
        f"bounds from this model's sensitivity to {to} ({c.sqnr_db:.1f} dB, top-1 "
        f"{c.argmax_agree:.3f} with {how}), below {cap[0]:g} dB / {cap[1]:g}")
    return limits, note


def activation_limits(model, collect, clean: list) -> tuple[tuple, str]:
    """The (minimum SQNR, minimum top-1) a correct quantized program of `model` meets against
    it, and a note. Its kernels round the dynamic activations their own way (XNNPACK's zero
    points and ties are not torchao's), so where the weights are the same a program and its
    eager model differ by at most a second rounding of every activation: `model`'s logits with
    its activations unrounded (`collect(model)`) against its `clean` ones measure what one
    rounding costs this model (a real model's large activations and outlier channels make it
    large); a second costs as much again, and the bounds are ACTIVATION_MARGIN_DB below it and
    twice its argmax flips, the SQNR bound both ways (a model its rounding moves little holds
    its program as close: at 20 dB, one value projection 10% off passed) up to fp32's, the
    top-1 one never above THRESHOLDS["quantized"]'s; a model whose linears round no activations
    (weight-only recipes) keeps those."""
    weights = [m.weight for m in model.modules()
               if getattr(getattr(m, "weight", None), "activation_quantization", None)]
    cap = THRESHOLDS["quantized"]
    if not weights:
        return cap, ""
    kinds = [w.activation_quantization for w in weights]
    try:
        for w in weights:
            w.activation_quantization = None
        unrounded = collect(model)
    finally:
        for w, kind in zip(weights, kinds):
            w.activation_quantization = kind
    return sensitivity_limits(compare(torch.cat(unrounded), torch.cat(clean)), cap,
                              ACTIVATION_MARGIN_DB, "its activations' rounding", "them unrounded",
                              ceiling_db=THRESHOLDS["fp32"][0])


def verify(target, steps: int = 8) -> dict:
    """Verify an export folder (or its model.pte) against the checkpoint its config.yaml names.
    Returns {"passed", "checks": [...], "perplexity"}; raises nothing for a failed check (see
    `enforce`). The eager model is made as the export made it (eager.eager_model), and checked
    by the same `Verification` an export feeds as it goes."""
    from . import patches
    from .backends import plan_for
    from .config import resolve_config
    from .capture import export_forward
    from .eager import eager_model
    from .memory import release_memory
    from .progress import Stages

    folder = Path(target).parent if Path(target).suffix == ".pte" else Path(target)
    if not (folder / "config.yaml").is_file():
        raise InputError(f"No config.yaml in {folder}: verify needs the folder an edgellm export "
                         "wrote (model.pte beside config.yaml).")
    cfg = resolve_config(config=folder / "config.yaml")
    plan = plan_for(cfg)
    check = Verification(cfg, plan, Stages(quiet=True), steps)
    with patches.scope():  # the quantization's, taken off again
        eager = eager_model(cfg, plan, check.stages, check.take)
        if check.stand_in_needed:
            check.take("export", {"forward": export_forward(eager.model, cfg.max_seq_len,
                                                            plan.dynamic_shapes)})
        del eager
        release_memory()  # modules hold cycles (bound hooks): free the eager model now
        check.take("files", folder)
    return check.result


class Verification:
    """verify's work as a consumer of an export's stage products (`take`), so that an export
    checks the eager model it built and quantized instead of building and quantizing a second
    one. Each product is used when it is made and not kept; the work is timed as stages:

    - "load" (the Source): kept until "build", for transformers.
    - "build" (edgellm's model, not yet quantized) -> stage "reference": transformers' greedy
      continuations and logits on the prompts and along the shipped text, then the rewrite check
      (edgellm's model in fp32: this one, or one built here when the export is not fp32). The
      program's expected logits are the rewrite's when it is fp32 and not quantized, else this
      model's when it is not quantized.
    - "quantize" (the quantized model) -> stage "expected": the logits the program must match,
      and the quantized model's along the text, and the program check's bounds from its
      sensitivity to its activations' rounding (`activation_limits`).
    - "export" (the exported programs) -> stage "graph", for programs this machine cannot run:
      the exported graph of `forward` stands in for the program.
    - "files" (the written folder) -> stage "verify": the program itself where it runs, the
      quantization cost against fp32, perplexity; `result` holds verify's answer.

    The runs leave the model's caches written; that changes no exported program, whose mutated
    buffers keep only their shape and dtype (tested: the same bytes with and without
    verification)."""

    def __init__(self, cfg, plan, stages, steps: int = 8):
        self.cfg, self.plan, self.stages = cfg, plan, stages
        # what every check runs within: the cache, or with attention sinks the positions before
        # the first eviction, past which the program is no longer transformers' full attention
        self.context = min(cfg.context_len, sum(cfg.attention_sink or (cfg.context_len,)))
        self.steps = max(1, min(steps, self.context // 2))  # prompt and steps fit the cache
        self.weights_quantized = bool(cfg.quantize or cfg.embedding_quantize)
        self.quantized = self.weights_quantized or cfg.kv_cache is not None
        self.limits = THRESHOLDS["quantized" if self.quantized else cfg.dtype]
        self.limits_note = ""  # why the program's limits are below THRESHOLDS
        self.stand_in_needed = not all(b.runs_here for b in plan.backends)
        self.source = self.text = self.cases = self.ref = self.ref_text = None
        self.checks, self.expected, self.candidate, self.result = [], None, None, None
        self.expected_text = self.cache_rows = self.fp32_rows = None

    def take(self, stage: str, product) -> None:
        """A stage's product, as it is made (by eager.eager_model and the export job)."""
        if stage == "load":
            fits(product)
            self.source = product
        elif stage == "build":
            with self.stages.stage("reference"):
                self._reference(product)
        elif stage == "quantize":
            with self.stages.stage("expected"):
                self._expect(product)
        elif stage == "export" and self.stand_in_needed:
            with self.stages.stage("graph"):
                self._stand_in(product["forward"])
        elif stage == "files":
            with self.stages.stage("verify"):
                self.result = self._finish(product)

    def _reference(self, model) -> None:
        from .architectures import build_model, load_deferred
        from .memory import release_memory

        cfg, source = self.cfg, self.source
        load_deferred(model)  # the float model whole: its experts, were a recipe to pack them
        longest = min(cfg.max_seq_len, self.context - self.steps)
        self.text = text_tokens(source.tokenizer(), self.context)
        reference = transformers_model(source)
        runs = [(p, *reference_run(reference, p, self.steps))
                for p in prompts(source.hf_config.vocab_size, longest, self.text)]
        self.cases, self.ref = [(p, t) for p, t, _ in runs], [logits for _, _, logits in runs]
        if self.text:
            with torch.no_grad():
                self.ref_text = reference(torch.tensor([self.text])).logits[0, :-1].float()
        del reference, runs
        release_memory()  # transformers' modules hold cycles too
        if cfg.dtype == "fp32":
            with float_caches(model):  # the rewrite's math; an int8 cache is a recipe
                actual = self.collect_eager(model)
                limits = rounding_limits(model, self.collect_eager, actual)
        else:
            opts = self.plan.model_options(cfg, source.stored_types)
            fp32 = build_model(source.hf_config, source.state_dict, opts, torch.float32)
            with float_caches(fp32):
                actual = self.collect_eager(fp32)
                limits = rounding_limits(fp32, self.collect_eager, actual)
            del fp32
            release_memory()
            self.fp32_rows = actual  # what rounding to the program's dtype costs (_expect)
        if not self.quantized and cfg.dtype == "fp32":  # the program is the rewrite
            self.limits, self.limits_note = limits
        self.checks = [measure("rewrite", actual, self.ref, *limits)]
        if cfg.kv_cache:  # the cache's own cost, on the model before any weight recipe
            text = [([], self.text)] if self.text else None
            with float_caches(model):
                floats = self.collect_eager(model, text)
            self.cache_rows = (self.collect_eager(model, text), floats)
        if not self.weights_quantized:  # the program is built as this model was
            if cfg.dtype == "fp32" and not cfg.kv_cache:
                self.expected = actual
            else:
                self._expect(model)
        self.source = None

    def _expect(self, model) -> None:
        """What the program must match: the model as it is built and quantized, on the prompts
        and, quantized, along the text too (a rounding flip moves one row's SQNR by 10 dB either
        way: the prompts' 16 rows alone would decide by chance), within the bounds its
        sensitivity to its activations' rounding allows (activation_limits)."""
        self.expected = self.collect_eager(model)
        if not self.quantized:  # a float program in fp16 or bf16: the model in it
            self.limits, self.limits_note = dtype_limits(
                compare(torch.cat(self.expected), torch.cat(self.fp32_rows)), self.cfg.dtype)
            self.fp32_rows = None
            return
        cases = self.cases + [([], self.text)] * bool(self.text)
        if self.text:
            self.expected_text = self.collect_eager(model, cases[-1:])[0]
        self.limits, self.limits_note = activation_limits(
            model, lambda m: self.collect_eager(m, cases),
            self.expected + [self.expected_text] * bool(self.text))

    def collect(self, forward, prefill) -> list:
        """Logits along every case, the prompt in one call and then a token per call, as the
        program runs; eager custom ops log from C++ like the runtime's kernels."""
        from .program import native_logs

        with torch.no_grad(), native_logs():
            return [run_steps(forward, prefill, p, t) for p, t in self.cases]

    def collect_eager(self, model, cases: list | None = None) -> list:
        """An eager model's logits along every case (default: the prompts' `cases`), each case's
        sequence in one call: the same math as collect's calls (a causal model; per-token
        activation scales), without a pass over every weight per generated token (dequantizing
        them, for a quantized model). A case with no prompt gives logits after each token of its
        continuation but the last, as run_steps does for the text."""
        from .program import native_logs

        with torch.no_grad(), native_logs():
            return [sequence_logits(model, p + t[:-1], self.cfg.max_seq_len)[max(len(p) - 1, 0):]
                    for p, t in (self.cases if cases is None else cases)]

    def _stand_in(self, exported) -> None:
        """The exported graph (an ExportedProgram of `forward`) in place of the program."""
        from .program import native_logs

        graph = exported.module()
        prefill = eager_prefill(graph) if self.plan.dynamic_shapes else one_by_one(graph)
        actual = self.collect(graph, prefill)
        text_logits = None
        if self.text:
            with torch.no_grad(), native_logs():
                text_logits = run_steps(graph, prefill, self.text[:1], self.text[1:])
        self.candidate = (actual, text_logits)

    def _finish(self, folder: Path) -> dict:
        from .program import native_logs

        cfg, checks, expected = self.cfg, list(self.checks), self.expected
        if self.stand_in_needed:
            names = ", ".join(b.name for b in self.plan.backends if not b.runs_here)
            level = "exported graph"
            note = (f"the {names} delegate was not executed: this machine's ExecuTorch runtime "
                    "cannot run it; the exported graph before lowering was checked")
            actual, text_logits = self.candidate
        else:
            from .program import Program

            program = Program(folder / "model.pte")
            level, note = "program", ""
            actual = self.collect(program.forward, program.prefill)
            if self.text:
                with torch.no_grad(), native_logs():
                    text_logits = run_steps(program.forward, program.prefill, self.text[:1],
                                            self.text[1:])
        note = "; ".join(n for n in (note, self.limits_note) if n)
        with_text = self.expected_text is not None
        if with_text:
            actual, expected = actual + [text_logits], expected + [self.expected_text]
        checks.append(measure(level, actual, expected, self.limits, note=note,
                              text_last=with_text))
        if self.quantized:  # what the recipe costs, against the float model
            # natural text where there is a tokenizer: random ids give a real model flat logits
            # whose argmax a small error flips, which says little about the recipe
            on = ((f"along {len(self.text)} tokens of {TEXT.name}", [text_logits],
                   [self.ref_text]) if self.text else ("on the prompts", actual, self.ref))
            checks.append(recipe_cost(cfg, level, *on, text=self.text))
        if cfg.kv_cache:
            checks.append(cache_cost(cfg, on[0], *self.cache_rows))
        result = {"passed": all(c.passed for c in checks), "steps": self.steps,
                  "prompts": [len(p) for p, _ in self.cases],
                  "checks": [asdict(c) for c in checks]}
        if self.text:
            agree = (text_logits.argmax(-1) == self.ref_text.argmax(-1)).float().mean()
            result["perplexity"] = {
                "text": TEXT.name, "tokens": len(self.text),
                "transformers_fp32": round(perplexity(self.ref_text, self.text), 4),
                level.replace(" ", "_"): round(perplexity(text_logits, self.text), 4),
                "top1_vs_fp32": round(float(agree), 4),
                # fp32's token after each of the text's but the last: what another engine's
                # top-1 along the same ids is measured against (sweeps/llamacpp.py)
                "fp32_argmax": self.ref_text.argmax(-1).tolist()}
            if cfg.kv_cache:  # the model before its weight recipe, with and without it
                int8, floats = (rows[0] for rows in self.cache_rows)
                result["perplexity"].update({
                    f"model_{cfg.dtype}_caches": round(perplexity(floats, self.text), 4),
                    f"model_{cfg.kv_cache}_caches": round(perplexity(int8, self.text), 4)})
        return result


TEXT = Path(__file__).parent / "data" / "perplexity.txt"
def recipe_cost(cfg, level: str, on: str, actual: list, reference: list,
                text: list[int] | None = None) -> Check:
    """The quantization check: `level` (program or exported graph) against transformers in fp32,
    within the recipe's bounds; along the shipped text (`text`: its ids, whose logits `actual`
    and `reference` are), its perplexity too, as a ratio to fp32's."""
    from dataclasses import replace

    from .quantize import accuracy_bounds

    recipe = "+".join(filter(None, [cfg.quantize, cfg.embedding_quantize and
                                    f"embeddings {cfg.embedding_quantize}",
                                    cfg.kv_cache and f"{cfg.kv_cache} KV cache"]))
    bounds = accuracy_bounds(cfg)
    check = measure("quantization", actual, reference, bounds,
                    note=f"{recipe}: the {level} against transformers in fp32, {on}",
                    text_last=bool(text))
    if not text:
        return check
    ratio = perplexity(actual[0], text) / perplexity(reference[0], text)
    return replace(check, passed=check.passed and ratio <= bounds[2],
                   perplexity_ratio=round(ratio, 4), max_perplexity_ratio=bounds[2])


def cache_cost(cfg, on: str, actual: list, float_cache: list) -> Check:
    """The KV cache check: edgellm's eager model before any weight recipe, with the cache dtype
    against itself with float caches, within the cache dtype's bounds: the cache's own cost.
    (Measured after a recipe of dynamically quantized activations it would be that recipe's
    amplification of any small change: on the embedded SmolLM2's 8da4w, XNNPACK's rounding alone
    moves the program as far from its eager model. The quantization check gives both together,
    against fp32.)"""
    from .quantize.recipes import KV_CACHE_BOUNDS

    return measure("kv cache", actual, float_cache, KV_CACHE_BOUNDS[cfg.kv_cache],
                   note=f"{cfg.kv_cache} KV cache: the {cfg.dtype} model against itself with "
                        f"{cfg.dtype} caches, before any weight recipe, {on}")


def text_tokens(tokenizer, limit: int) -> list[int] | None:
    """The shipped English text through the model's tokenizer (tokenizers.Tokenizer), at most
    `limit` tokens (None without a tokenizer: perplexity is then not measured)."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(TEXT.read_text()).ids[:min(limit, 128)]
    return ids if len(ids) > 1 else None


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given logits row i for ids[i + 1]."""
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return float(nll.exp())


def fits(source) -> None:
    """Refuse, before any work, a verification this machine cannot hold: transformers' fp32 model
    and edgellm's float model side by side, 8 bytes a parameter (a checkpoint streamed past memory
    by a recipe, moe.Deferred, is read whole for them)."""
    from .eager import size
    from .memory import available_bytes

    count = sum(math.prod(t.shape) for t in source.state_dict.values())
    need, have = 8 * count, available_bytes()
    if have is not None and need > have:
        raise InputError(f"Verification holds transformers' fp32 model beside edgellm's float "
                         f"model: about {size(need)} for {count / 1e9:.2f} B parameters, and "
                         f"this machine has {size(have)} available. Export with --no-verify (the "
                         "architecture is checked against transformers on tiny checkpoints by "
                         "edgellm's tests), or verify on a machine with more memory.")


def one_by_one(forward):
    def prefill(ids):
        for i, tok in enumerate(ids):
            out = forward(torch.tensor([[tok]]), torch.tensor([i]))
        return out
    return prefill


def transformers_model(source):
    """transformers' own model on the source's weights (assigned: fp32 tensors are shared, others
    converted)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is assigned below; skip the random init
        model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32)
    state = {k: v.float() for k, v in source.state_dict.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise InputError(f"transformers' model does not take this checkpoint: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if missing:
        model.tie_weights()
    return model.eval()


def enforce(result: dict, what: str) -> None:
    from .report import verify_summary

    if not result["passed"]:
        failed = [c["level"] for c in result["checks"] if not c["passed"]]
        raise VerificationError(f"{what} failed verification ({', '.join(failed)}):\n"
                                f"{verify_summary(result)}")
