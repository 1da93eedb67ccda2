"""llama.cpp beside a sweep (`--beside FILE.gguf`): the file run by llama.cpp, through
llama-cpp-python in an interpreter of the user's choosing (it need not be edgellm's), along the
same token ids of the shipped text the sweep's exports were verified on, a token per call from
position 0 (its perplexity, and its top-1 against transformers' fp32 argmax there), and timed
as their benchmarks are (a BENCH_PROMPT-token prefill, BENCH_STEPS greedy steps, the cores this
process may use): one more row of the sweep's table, whose size is the file's bytes and whose
perplexity sits beside the exports' and transformers' fp32 one."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

from ..errors import InputError

BACKEND = "llama.cpp"

SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=max(512, len(a["ids"]) + 8),
                      n_batch=512, n_threads=a["threads"], n_threads_batch=a["threads"],
                      verbose=False)

def last_logits():  # Llama.eval keeps no scores unless logits_all: the context's last row
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)

nll, agree = 0.0, 0
for i, tok in enumerate(a["ids"][:-1]):
    llm.eval([tok])
    row = last_logits()
    top = row.max()
    nll += top + np.log(np.exp(row - top).sum()) - row[a["ids"][i + 1]]
    agree += bool(a["fp32_argmax"]) and int(np.argmax(row)) == a["fp32_argmax"][i]
prompt = [(7 * i + 1) % llm.n_vocab() for i in range(a["prompt"])]
llm.reset()
t0 = time.perf_counter()
llm.eval(prompt)
prefill = time.perf_counter() - t0
steps = []
for _ in range(a["steps"]):
    tok = int(np.argmax(last_logits()))
    t0 = time.perf_counter()
    llm.eval([tok])
    steps.append(time.perf_counter() - t0)
print(json.dumps(dict(version=llama_cpp.__version__,
                      perplexity=float(np.exp(nll / (len(a["ids"]) - 1))),
                      top1=agree / (len(a["ids"]) - 1) if a["fp32_argmax"] else None,
                      prefill_tok_s=a["prompt"] / prefill,
                      decode_tok_s=1 / float(np.median(steps)))))
"""


def check(gguf, python: str) -> Path:
    """The file to run beside the sweep, refused at once (before any export) when it is not a
    GGUF or `python` cannot import llama_cpp."""
    path = Path(gguf)
    if path.suffix != ".gguf" or not path.is_file():
        raise InputError(f"--beside: {gguf} is not a .gguf file")
    try:
        done = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    except OSError as e:
        raise InputError(f"--llamacpp-python: {python} does not run ({e.strerror})") from None
    if done.returncode != 0:
        raise InputError(f"--beside: {python} cannot import llama_cpp; install it there (pip "
                         "install llama-cpp-python) or name an interpreter that has it with "
                         "--llamacpp-python")
    return path.resolve()


def text_ids(model, tokens: int, tokenizer_path: str | None = None) -> list[int]:
    """The first `tokens` ids of the shipped text through the sweep's model's tokenizer (or the
    sweep's `tokenizer` override): the ids its exports' perplexity was measured on
    (verification.text_tokens)."""
    from ..sources import default_model_path
    from ..sources.base import load_tokenizer
    from ..sources.gguf import tokenizer_of
    from ..verification import text_tokens

    path = Path(model) if model else default_model_path()
    tokenizer = (load_tokenizer(Path(tokenizer_path)) if tokenizer_path else
                 tokenizer_of(path).tokenizer() if path.suffix == ".gguf" else load_tokenizer(path))
    return text_tokens(tokenizer, tokens)


def row(gguf: Path, python: str, ids: list[int], fp32: dict, prompt: int, steps: int) -> dict:
    """The table's row for `gguf` run by llama.cpp (see the module's docstring); `fp32`: a
    verified report's perplexity entry (transformers' perplexity and argmax along `ids`), or {}."""
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    argmax = fp32.get("fp32_argmax")
    argmax = argmax if argmax and len(argmax) == len(ids) - 1 else None
    args = {"gguf": str(gguf), "ids": ids, "prompt": prompt, "steps": steps, "threads": threads,
            "fp32_argmax": argmax}
    out = {"name": f"{BACKEND}-{gguf.stem}", "model": str(gguf), "backend": BACKEND,
           "recipe": gguf.name, "key": key(gguf, python, ids, prompt, steps),
           "host": socket.gethostname(), "pte_bytes": gguf.stat().st_size, "export_s": None,
           "peak_rss_mb": None, "estimated_peak_mb": None, "verified": None}
    done = subprocess.run([python, "-c", SCRIPT, json.dumps(args)], capture_output=True,
                          text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        code = done.returncode
        error = (done.stderr.strip().splitlines() or [
            f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"])[-1]
        return {**out, "status": "failed", "error": f"llama.cpp: {error}"}
    r = json.loads(lines[-1])
    return {**out, "status": "ok", "error": None, "llama_cpp_python": r["version"],
            "accuracy": {"sqnr_db": None, "top1": None, "perplexity": round(r["perplexity"], 4),
                         "perplexity_fp32": fp32.get("transformers_fp32"),
                         "text_top1": None if r["top1"] is None else round(r["top1"], 4)},
            "speed": {"prompt_tokens": prompt, "decode_steps": steps,
                      "prefill_tok_s": round(r["prefill_tok_s"], 2),
                      "decode_tok_s": round(r["decode_tok_s"], 2)}}


def key(gguf: Path, python: str, ids: list[int], prompt: int, steps: int) -> str:
    """What the row depends on: the file (name, size, time), the interpreter running llama.cpp,
    the ids and the bench's lengths."""
    stat = gguf.stat()
    return hashlib.sha256(json.dumps([str(gguf), stat.st_size, stat.st_mtime_ns, python, ids,
                                      prompt, steps]).encode()).hexdigest()
