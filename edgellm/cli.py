"""The `edgellm` command: thin shells over the Python API, with the same names.

Exit codes (`main`'s): 0 success; 1 a program failed verification (its outputs kept), or some
exports of a sweep were not ok; 2 bad input; 3 an internal error in edgellm or a library it
drives; 130 interrupted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import typing

from .errors import EdgeLLMError
from .memory import YOUNG_COLLECTION_EVERY
from .run.openmp import one_thread_per_team


def _export_parser(sub):
    from .config import ExportConfig

    p = sub.add_parser("export", help="export a model to an ExecuTorch program",
                       description="Export MODEL (a Hugging Face folder, .gguf or ExecuTorch "
                       ".pth file; the embedded SmolLM2-135M when omitted). Arguments of the "
                       "form key=value override config fields (a leading '+' is accepted), e.g. "
                       "coreml.min_ios=17.")
    p.add_argument("args", nargs="*", metavar="MODEL|key=value")
    p.add_argument("--config", help="YAML config file; `OUT/config.yaml` replays an export")
    hints = typing.get_type_hints(ExportConfig)
    for f in export_options():
        meta, kind = f.metadata, hints[f.name]
        names = [n for n in (meta["short"], meta["flag"] or flag_of(f.name)) if n]
        if kind is bool:  # --etrecord sets True, --no-verify False
            p.add_argument(*names, dest=f.name, action="store_false" if f.default else
                           "store_true", default=None, help=meta["help"])
        else:  # integers parsed here; lists ("coreml,xnnpack") and the rest by the config
            p.add_argument(*names, dest=f.name, help=meta["help"], metavar=meta["metavar"],
                           choices=meta["choices"],
                           type=int if int in (kind, *typing.get_args(kind)) else None)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def export_options() -> list:
    """ExportConfig's fields that are `edgellm export` flags: all but the model (positional)."""
    import dataclasses

    from .config import ExportConfig

    return [f for f in dataclasses.fields(ExportConfig) if f.metadata.get("cli")]


def cmd_export(a) -> int:
    from . import export
    from .report import summary

    model, overrides = model_and_overrides(a.args)
    options = {f.name: getattr(a, f.name) for f in export_options()}
    report = export(model, config=a.config, overrides=overrides,
                    quiet=a.quiet or a.json, **options)
    print(json.dumps(report) if a.json else summary(report))
    return 0


def model_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """MODEL (at most one) and the key=value overrides among a command's positionals."""
    models = [x for x in args if "=" not in x]
    if len(models) > 1:
        raise_input(f"give at most one MODEL, got {len(models)}: {' '.join(models)}")
    return (models[0] if models else None), [x for x in args if "=" in x]


def sampling_flags(parser) -> None:
    """Sampling's fields as flags (--top-k for top_k), but max_tokens (each command's -n)."""
    import dataclasses

    from .run.sampling import HELP, Sampling

    for f in dataclasses.fields(Sampling):
        if f.name == "max_tokens":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "stop":
            parser.add_argument(flag, action="append", default=[], help=HELP[f.name])
        else:
            kind = int if str(f.type).startswith("int") else float  # "int | None": seed
            parser.add_argument(flag, type=kind, default=f.default, help=HELP[f.name])


def sampling_of(a) -> dict:
    import dataclasses

    from .run.sampling import Sampling

    return {f.name: getattr(a, f.name) for f in dataclasses.fields(Sampling)
            if f.name != "max_tokens"}


def show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(a) -> int:
    from . import generate

    generate(a.pte, a.prompt, n=a.n, tokenizer=a.tokenizer, on_text=show, chat=a.chat,
             **sampling_of(a))
    sys.stdout.write("\n")
    return 0


def cmd_chat(a) -> int:
    from .run.chat import chat

    chat(a.target, n=a.n, system=a.system, **sampling_of(a))
    return 0


def cmd_serve(a) -> int:
    from .run.serve import serve

    serve(a.target, host=a.host, port=a.port, queue=a.queue)
    return 0


def cmd_models(a) -> int:
    from . import models

    info = models()
    print("architectures (Hugging Face model_type; read from a folder, a GGUF, a .pth):")
    for name, text in info["architectures"].items():
        print(f"  {name:<12} {text} [{', '.join(info['inputs'][name])}]")
    print("backends (chain them in order, e.g. coreml,xnnpack):")
    for name, text in info["backends"].items():
        print(f"  {name:<12} {text}")
    print("every architecture exports to every backend and chain (XNNPACK, the CPU fallback, "
          "goes last).")
    print("quantize (--quantize; --embedding-quantize 8 or 4,GROUP):")
    for name, backends in info["quantize"].items():
        print(f"  {name:<10} {', '.join(backends)}")
    print(f"  {'embeddings':<10} {', '.join(info['embedding_quantize'])}")
    return 0


def quiet_libraries() -> None:
    """Keep the terminal to edgellm's own lines: the libraries below warn about their own internals
    (deprecations inside torch and coremltools, optional torchao kernels for GPUs) and draw
    progress bars of their own. Lowering still counts deprecation warnings for the report;
    --debug shows everything."""
    import logging
    import os
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' per-pass progress bars
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # set again on its import
    from . import program

    program.QUIET_NATIVE_LOGS = True
    for name in ("torchao", "torch.utils._pytree", "coremltools",
                 "executorch.backends.apple.coreml.compiler.coreml_preprocess"):
        logging.getLogger(name).setLevel(logging.ERROR)


def raise_input(msg: str):
    from .errors import InputError

    raise InputError(msg)


def cmd_verify(a) -> int:
    from . import verify
    from .report import verify_summary
    from .verification import enforce

    result = verify(a.target, steps=a.steps)
    print(json.dumps(result) if a.json else verify_summary(result))
    enforce(result, str(a.target))
    return 0


def cmd_bench(a) -> int:
    from . import bench
    from .run.benchmark import table

    try:
        lengths = [int(n) for n in a.prompt_lengths.split(",") if n.strip()]
    except ValueError:
        raise_input(f"--prompt-lengths takes integers separated by commas, got "
                    f"{a.prompt_lengths!r}")
    try:
        depths = [int(n) for n in a.depth.split(",") if n.strip()] if a.depth else []
    except ValueError:
        raise_input(f"--depth takes integers separated by commas, got {a.depth!r}")
    result = bench(a.target, prompt_lengths=lengths, steps=a.steps, repeats=a.repeats,
                   depths=depths)
    print(table(result))
    print(json.dumps(result))
    return 0


def cmd_sweep(a) -> int:
    from . import sweep
    from .config import apply_overrides
    from .sweeps import summary_table

    model, pairs = model_and_overrides(a.args)
    overrides = apply_overrides({}, pairs)
    if a.max_seq_len is not None:
        overrides["max_seq_len"] = a.max_seq_len
    rows = sweep(model, backends=a.backends, recipes=a.recipes,
                 output=a.output, workers=a.workers, ray=a.ray, bench=a.bench, quiet=a.quiet,
                 beside=a.beside, llamacpp_python=a.llamacpp_python, **overrides)
    print(summary_table(rows))
    bad = [r["name"] for r in rows if r["status"] != "ok"]
    if bad:
        print(f"edgellm: {len(bad)} of {len(rows)} exports not ok ({', '.join(bad)}): their "
              f"rows in {a.output}/results.json say why", file=sys.stderr)
    return 1 if bad else 0


def cmd_explore(a) -> int:
    from .report.explore import explore

    explore(a.target, port=a.port, browser=a.browser)
    return 0


def _sweep_parser(sub) -> None:
    from .sweeps import RECIPE_GRAMMAR

    s = sub.add_parser("sweep", help="export one model in many recipes on many backends, with "
                       "a visual report (DIR/index.html)",
                       description="Export MODEL (the embedded SmolLM2-135M when omitted) once "
                       "per backend and recipe into DIR/<backend>-<recipe>/, verify and bench "
                       "each, and write DIR/results.json, results.csv and index.html. Arguments "
                       "key=value set a config field for every export (e.g. max_context_len=1024"
                       "). An export whose config and inputs are unchanged is not redone.")
    s.add_argument("args", nargs="*", metavar="MODEL|key=value")
    s.add_argument("--backends", default="xnnpack", help="comma-separated backends (default "
                   "xnnpack)")
    s.add_argument("--recipes", default="fp32,8da8w,8da4w,8da4w+emb4",
                   help=f"comma-separated recipes (default fp32,8da8w,8da4w,8da4w+emb4); a "
                   f"recipe is {RECIPE_GRAMMAR}")
    s.add_argument("-o", "--output", default="edgellm-sweep", help="output folder (default "
                   "edgellm-sweep)")
    s.add_argument("--max-seq-len", type=int, help="as for export (default 128)")
    s.add_argument("--workers", type=int, help="exports at once at most on this machine "
                   "(default: the cores; fewer when the estimated peaks do not fit in memory)")
    s.add_argument("--ray", metavar="ADDRESS", help="run each export as a Ray task on the "
                   "cluster at ADDRESS, or 'local' to start one on this machine (edgellm[ray])")
    s.add_argument("--no-bench", dest="bench", action="store_false", help="skip the speed "
                   "measurements")
    s.add_argument("--beside", metavar="FILE.gguf", help="also run this GGUF with llama.cpp "
                   "along the same text, timed as the exports are: one more row (e.g. "
                   "llama.cpp's Q4_K_M of the same model)")
    s.add_argument("--llamacpp-python", metavar="PYTHON", help="an interpreter that imports "
                   "llama_cpp (pip install llama-cpp-python), for --beside (default: this one)")
    s.add_argument("--quiet", action="store_true", help="no progress lines")


def cmd_compare(a) -> int:
    from . import compare
    from .report import compare_table

    result = compare(a.a, a.b, method=a.method)
    print(json.dumps(result) if a.json else compare_table(result, (a.a, a.b)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgellm", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _export_parser(sub)
    g = sub.add_parser("generate", help="text generation from an exported program (greedy, "
                       "or sampled)")
    g.add_argument("pte")
    g.add_argument("--prompt", required=True)
    g.add_argument("-n", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--chat", action="store_true",
                   help="the prompt as a user message in the model's chat template")
    g.add_argument("--tokenizer", help="tokenizer.json (default: beside the program)")
    sampling_flags(g)
    ch = sub.add_parser("chat", help="talk to an exported program: a REPL on a terminal, a "
                        "message per line otherwise")
    ch.add_argument("target", metavar="OUT", help="export folder or its model.pte")
    ch.add_argument("-n", type=int, default=512, help="tokens per reply at most (default 512)")
    ch.add_argument("--system", help="system message the conversation starts with")
    sampling_flags(ch)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for an exported program")
    sv.add_argument("target", metavar="OUT", help="export folder or its model.pte")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                    "127.0.0.1)")
    sv.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    sv.add_argument("--queue", type=int, default=16, help="requests waiting for the program at "
                    "most; past that, 503 with Retry-After (default 16)")
    _sweep_parser(sub)
    e = sub.add_parser("explore", help="open an exported program in Google's Model Explorer")
    e.add_argument("target", metavar="OUT", help="export folder or its model.pte")
    e.add_argument("--port", type=int, default=8080, help="Model Explorer's port (default 8080)")
    e.add_argument("--no-browser", dest="browser", action="store_false",
                   help="serve only; print the address")
    sub.add_parser("models", help="architectures, backends and supported combinations")
    v = sub.add_parser("verify", help="check an exported program against its checkpoint")
    v.add_argument("target", metavar="OUT", help="export folder or its model.pte")
    v.add_argument("--steps", type=int, default=8, help="decode steps per prompt (default 8)")
    v.add_argument("--json", action="store_true", help="print the result as one JSON object")
    b = sub.add_parser("bench", help="speed of an exported program on this machine")
    b.add_argument("target", metavar="OUT", help="export folder or its model.pte")
    b.add_argument("--prompt-lengths", default="64",
                   help="comma-separated prompt lengths for prefill (default 64)")
    b.add_argument("--steps", type=int, default=32, help="decode steps per run (default 32)")
    b.add_argument("--repeats", type=int, default=3, help="runs; the best is kept (default 3)")
    b.add_argument("--depth", help="comma-separated context depths, e.g. 0,1024,4096: prefill "
                                   "and decode measured again after that many tokens")
    c = sub.add_parser("compare", help="two exports side by side: delegation and per-op deltas")
    c.add_argument("a", metavar="A", help="export folder or its report.json")
    c.add_argument("b", metavar="B", help="export folder or its report.json")
    c.add_argument("--method", default="forward", help="method to compare (default forward)")
    c.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    a, extra = parser.parse_known_args(argv)
    if a.command in ("export", "sweep") and not any(x.startswith("-") for x in extra):
        a.args += extra  # MODEL and key=value may come after the options too
    elif extra:
        parser.error(unrecognized(extra, a.command))
    if a.command in ("bench", "generate", "chat", "serve"):  # they only run programs:
        one_thread_per_team()  # before anything imports torch (run/openmp.py)
    if not a.debug:
        quiet_libraries()
    run = {"export": cmd_export, "generate": cmd_generate, "models": cmd_models,
           "compare": cmd_compare, "verify": cmd_verify, "bench": cmd_bench, "chat": cmd_chat,
           "serve": cmd_serve, "sweep": cmd_sweep, "explore": cmd_explore}[a.command]
    try:
        code = run(a)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be caught
        return code
    except EdgeLLMError as e:
        if a.debug:
            raise
        print(f"edgellm: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        kept = {"export": "; nothing was written to the output folder",
                "sweep": "; results.json keeps the exports done (a new sweep goes on from there)"}
        print("edgellm: interrupted" + kept.get(a.command, ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`edgellm models | head`): as Unix tools
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        return 0
    except Exception as e:  # a library failed in a way edgellm did not foresee
        if a.debug:
            raise
        where = _origin(e)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        kept = " Nothing was written to the output folder." if a.command == "export" else ""
        print(f"edgellm: internal error{where}: {type(e).__name__}: {first}.{kept} Rerun with "
              "--debug for the traceback and report it with the command line", file=sys.stderr)
        return 3


def unrecognized(extra: list[str], command: str) -> str:
    """argparse's complaint, with the nearest flag of `edgellm export` for a misspelt one."""
    import difflib

    text = f"unrecognized arguments: {' '.join(extra)}"
    if command == "export":
        flags = [f.metadata["flag"] or flag_of(f.name) for f in export_options()]
        flags += ["--config", "--quiet", "--json"]
        for x in extra:
            close = difflib.get_close_matches(x.split("=")[0], flags, n=1)
            if x.startswith("--") and close:
                text += f" (did you mean {close[0]}?)"
                break
    return text


def _origin(e: BaseException) -> str:
    """' in <package>' for the package whose frame raised e (torch, executorch, ...)."""
    tb = e.__traceback__
    while tb and tb.tb_next:
        tb = tb.tb_next
    name = tb.tb_frame.f_globals.get("__name__", "") if tb else ""
    return f" in {name.split('.')[0]}" if name else ""


def command() -> int:
    """The `edgellm` command: `main` in a process set up for one run. Young collections wait for
    YOUNG_COLLECTION_EVERY allocations from the start (with Python's 700, importing torch,
    ExecuTorch and coremltools makes several full collections), and afterwards every object
    still alive leaves the collector's sight (`gc.freeze`): the collections while the interpreter
    shuts down would otherwise traverse what the run left, hundreds of thousands of objects,
    more than once, for nothing, the files being written and closed. Not in `main`, which tests
    and other Python code call in processes that go on."""
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(command())
