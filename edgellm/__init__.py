"""edgellm: a Hugging Face or GGUF decoder LLM in, a lowered and verified ExecuTorch program out.

    import edgellm
    report = edgellm.export("path/to/hf-folder", backends="coreml,xnnpack", output="out")
    print(edgellm.generate("out/model.pte", "The capital of France is", n=16))

`import edgellm` is cheap: torch, ExecuTorch and the backend SDKs load when a function needs them.
"""

from __future__ import annotations

from .errors import ConfigError, EdgeLLMError, InputError, VerificationError

__all__ = ["export", "verify", "bench", "generate", "models", "compare", "sweep", "EdgeLLMError",
           "InputError", "ConfigError", "VerificationError"]


def export(model=None, *, config=None, overrides=(), quiet=False, **options) -> dict:
    """Export `model` (HF folder, .gguf or .pth, or None for the embedded default). `options` are
    ExportConfig fields (edgellm/config.py: output, backends, max_seq_len, quantize, ...), the
    names of `edgellm export`'s flags; a misspelt one is refused with the nearest. Returns the
    report, also written to OUTPUT/report.json."""
    from .config import resolve_config
    from .pipeline import export as run

    return run(resolve_config(model, config=config, overrides=overrides, **options), quiet=quiet)


def verify(target, steps: int = 8) -> dict:
    """Check an exported program (its folder or model.pte) against the checkpoint its
    config.yaml names: edgellm's eager model against transformers, then the program against the
    eager model. Returns the figures; `passed` is False when a threshold fails."""
    from .verification import verify as run

    return run(target, steps=steps)


def bench(target, prompt_lengths=(64,), steps: int = 32, repeats: int = 3, depths=()) -> dict:
    """Load time, time to first token, prefill and decode speed, peak RSS and decode against the
    memory-bandwidth floor measured in the same run, for an exported program on this machine;
    `depths`: the same again after a context of each many tokens."""
    from .run.benchmark import bench as run

    return run(target, prompt_lengths=prompt_lengths, steps=steps, repeats=repeats, depths=depths)


def generate(pte, prompt: str, n: int = 32, tokenizer=None, on_text=None, *, chat=False,
             **sampling) -> str:
    """Completion of `prompt` by an exported program, through the ExecuTorch runtime: greedy, or
    as `sampling` (sampling.Sampling's fields: temperature, top_k, top_p, min_p,
    repetition_penalty, seed, stop) says; up to `n` tokens; `chat`: the prompt as a user
    message in the model's chat template; `on_text` receives the text as it grows."""
    from .run.session import generate as run

    return run(pte, prompt, n=n, tokenizer=tokenizer, on_text=on_text, chat=chat, **sampling)


def sweep(model=None, *, backends="xnnpack", recipes="fp32,8da8w,8da4w,8da4w+emb4",
          output="edgellm-sweep", workers=None, ray=None, bench=True, quiet=False,
          **options) -> list[dict]:
    """Export `model` once per backend and recipe (sweeps.RECIPE_GRAMMAR: "8da4w-g32+emb4", ...)
    into OUTPUT/<backend>-<recipe>/, verify and (where the backend runs here) bench each, and
    write OUTPUT/results.json, results.csv and index.html; returns the rows. `options`:
    ExportConfig fields every export takes. `workers`: exports at once here at most (memory
    permitting); `ray`: a Ray address, or "local", to run each export as a Ray task."""
    from .sweeps import sweep as run

    return run(model, backends=backends, recipes=recipes, output=output, workers=workers,
               ray=ray, bench=bench, quiet=quiet, **options)


def compare(a, b, method: str = "forward") -> dict:
    """Two exports (folders or report.json files) side by side: subgraphs, delegated and
    non-delegated nodes, deprecation warnings, and every op whose count changed."""
    from .report import compare as run, load

    return run(load(a), load(b), method=method)


def models() -> dict:
    """Architectures (and what each is read from: a Hugging Face folder, a GGUF, an ExecuTorch
    .pth), backends, quantization recipes and which combinations are supported."""
    from .architectures import every
    from .backends import BACKENDS
    from .quantize import RECIPES

    architectures = {a.model_type: a.summary for a in every()}
    inputs = {a.model_type: ["folder"] + (["gguf"] if a.gguf else [])
              + ([".pth"] if a.executorch else []) for a in every()}
    return {"architectures": architectures, "inputs": inputs,
            "backends": {name: b.summary for name, b in BACKENDS.items()},
            "supported": {arch: list(BACKENDS) for arch in architectures},
            "quantize": {name: [b.name for b in BACKENDS.values() if name in b.recipes]
                         for name in RECIPES},
            "embedding_quantize": [b.name for b in BACKENDS.values() if b.quantized_embeddings]}
