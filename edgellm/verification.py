"""Checking an exported program against the model it came from, in two levels.

- rewrite: edgellm's eager model (written for the backend) against transformers on the same
  weights, both in float32: the re-authoring changed no math.
- program: the `.pte` through the ExecuTorch runtime against edgellm's eager model built exactly as
  the program was (dtype, quantization): the lowering changed no math. Programs this machine cannot
  run (Core ML, Vulkan) are checked one step earlier, as the exported graph (`torch.export`
  output) before any delegate, and the report says that the delegate itself did not run.
- quantization (quantized programs): the program against transformers in fp32, within the
  recipe's stated bounds: what the recipe costs in accuracy.

Every check feeds the same tokens to both sides (the reference's greedy continuation), over a
prefill and `steps` decode calls per prompt, starting each prompt at position 0 (which resets the
state), and reports max absolute and relative error, SQNR, top-1 agreement and the first step
whose greedy token differs. Thresholds depend on dtype and quantization.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import InputError, VerificationError

# (minimum SQNR dB, minimum top-1 agreement) per what is compared
THRESHOLDS = {"fp32": (60.0, 1.0), "fp16": (30.0, 0.9), "bf16": (20.0, 0.8),
              "quantized": (20.0, 0.8)}
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
    first_divergence: str | None  # "prompt i step j": the first differing greedy token
    note: str = ""


def prompts(vocab: int, longest: int, seed: int = 0) -> list[list[int]]:
    """Fixed pseudo-random token ids (no tokenizer needed), at most `longest` tokens each."""
    g = torch.Generator().manual_seed(seed)
    lengths = sorted({max(1, min(n, longest)) for n in PROMPT_LENGTHS})
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


def eager_prefill(model):
    """Prefill for an eager model or exported graph: the whole prompt in one call."""
    return lambda ids: model(torch.tensor([ids]), torch.tensor([0]))


def measure(level: str, actual: list, expected: list, limits: tuple, note: str = "") -> Check:
    from .numerics import compare

    c = compare(torch.cat(actual), torch.cat(expected))
    divergence = None
    for i, (a, e) in enumerate(zip(actual, expected)):
        step = next((j for j, (x, y) in enumerate(zip(a.argmax(-1), e.argmax(-1))) if x != y),
                    None)
        if step is not None:
            divergence = f"prompt {i} step {step}"
            break
    peak = float(torch.cat(expected).abs().max()) or 1.0
    passed = c.sqnr_db >= limits[0] and c.argmax_agree >= limits[1]
    return Check(level, passed, limits[0], limits[1], c.max_abs, c.max_abs / peak, c.sqnr_db,
                 c.argmax_agree, divergence, note)


def verify(target, steps: int = 8) -> dict:
    """Verify an export folder (or its model.pte) against the checkpoint its config.yaml names.
    Returns {"passed", "checks": [...]}; raises nothing for a failed check (see `enforce`).
    One model is alive at a time: transformers, then the eager model, then the program."""
    from . import resolve_config
    from .backends import plan_for
    from .progress import release_memory
    from .runtime import native_logs
    from .sources import load_source

    folder = Path(target).parent if Path(target).suffix == ".pte" else Path(target)
    if not (folder / "config.yaml").is_file():
        raise InputError(f"No config.yaml in {folder}: verify needs the folder an edgellm export "
                         "wrote (model.pte beside config.yaml).")
    cfg = resolve_config(config=folder / "config.yaml")
    plan = plan_for(cfg)
    source = load_source(cfg.model, params=cfg.params, model_class=cfg.model_class)
    steps = max(1, min(steps, cfg.context_len // 2))  # prompt and steps fit in the cache
    longest = min(cfg.max_seq_len, cfg.context_len - steps)
    reference = transformers_model(source)
    runs = [(p, *reference_run(reference, p, steps))
            for p in prompts(source.hf_config.vocab_size, longest)]
    cases, ref = [(p, t) for p, t, _ in runs], [logits for _, _, logits in runs]
    del reference, runs

    def collect(forward, prefill):  # eager custom ops log from C++ like the runtime's kernels
        with torch.no_grad(), native_logs():
            return [run_steps(forward, prefill, p, t) for p, t in cases]

    checks = eager_checks(cfg, plan, source, collect, ref)
    if all(b.runs_here for b in plan.backends):
        from .runtime import Program

        source.state_dict = {}  # the program holds its own weights; drop ours first
        release_memory()  # modules hold cycles (bound hooks): free the eager model now
        program = Program(folder / "model.pte")
        expected, limits = checks.pop()
        actual = collect(program.forward, program.prefill)
        checks.append(measure("program", actual, expected, limits))
        if cfg.quantize:  # what the recipe costs: the program against the float model
            from .quantize import ACCURACY_BOUNDS

            checks.append(measure("quantization", actual, ref, ACCURACY_BOUNDS[cfg.quantize],
                                  note=f"{cfg.quantize} program against transformers in fp32"))
    return {"passed": all(c.passed for c in checks), "steps": steps,
            "prompts": [len(p) for p, _ in cases], "checks": [asdict(c) for c in checks]}


def eager_checks(cfg, plan, source, collect, ref) -> list:
    """The rewrite check; then either the exported-graph check (programs that cannot run here)
    or, last in the list, (expected logits, limits) for the program check."""
    from .architectures import build_model
    from .capture import export_forward
    from .pipeline import TORCH_DTYPES

    opts = plan.model_options(cfg.context_len)
    eager = build_model(source.hf_config, dict(source.state_dict), opts, torch.float32)
    actual = collect(eager, eager_prefill(eager))
    checks = [measure("rewrite", actual, ref, THRESHOLDS["fp32"])]
    if cfg.dtype != "fp32" or cfg.quantize:  # the program's own numerics: build it that way
        eager = build_model(source.hf_config, dict(source.state_dict), opts,
                            TORCH_DTYPES[cfg.dtype])
        if cfg.quantize:
            from .quantize import quantize

            quantize(eager, cfg.quantize, cfg.group_size)
        actual = collect(eager, eager_prefill(eager))
    limits = THRESHOLDS["quantized" if cfg.quantize else cfg.dtype]
    if all(b.runs_here for b in plan.backends):
        return checks + [(actual, limits)]
    graph = export_forward(eager, cfg.max_seq_len, plan.dynamic_shapes).module()
    prefill = eager_prefill(graph) if plan.dynamic_shapes else one_by_one(graph)
    names = ", ".join(b.name for b in plan.backends if not b.runs_here)
    return checks + [measure("exported graph", collect(graph, prefill), actual, limits,
                             note=f"the {names} delegate was not executed: this machine's "
                                  "ExecuTorch runtime cannot run it; the exported graph before "
                                  "lowering was checked")]


def one_by_one(forward):
    def prefill(ids):
        for i, tok in enumerate(ids):
            out = forward(torch.tensor([[tok]]), torch.tensor([i]))
        return out
    return prefill


def transformers_model(source):
    """transformers' own model on the source's weights (assigned, not copied)."""
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


def summary(result: dict) -> str:
    lines = []
    for c in result["checks"]:
        status = "ok" if c["passed"] else "FAILED"
        div = c["first_divergence"] or "none"
        lines.append(f"{c['level']:>14}: {status}  SQNR {c['sqnr_db']:.1f} dB (min "
                     f"{c['min_sqnr_db']:.0f}), top-1 {c['top1']:.3f} (min {c['min_top1']}), "
                     f"max abs {c['max_abs']:.3g}, max rel {c['max_rel']:.3g}, first divergence "
                     f"{div}")
        if c["note"]:
            lines.append(f"{'':>16}{c['note']}")
    return "\n".join(lines)


def enforce(result: dict, what: str) -> None:
    if not result["passed"]:
        failed = [c["level"] for c in result["checks"] if not c["passed"]]
        raise VerificationError(f"{what} failed verification ({', '.join(failed)}):\n"
                                f"{summary(result)}")
