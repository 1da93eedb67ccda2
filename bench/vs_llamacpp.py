"""edgellm beside llama.cpp on the same GGUF file, in one run: each file exported with edgellm's
default recipe (the file's own quantization) for XNNPACK, then both engines along the shipped text
(edgellm/data/perplexity.txt, 128 tokens, one token per call from position 0) and timed with 2
threads each.

Per file: the program's size over the file's; the tokenizer's ids against llama.cpp's `tokenize`
of the same text; top-1 agreement of the program's logits with llama.cpp's own; both perplexities
and their ratio; each against transformers in fp32 on the file's dequantized weights (the
reference edgellm's verify uses); prefill (64 tokens) and decode (median of 32 steps) of
`edgellm bench` and of llama.cpp (bench/others.py). A table per file, then one JSON object per
file. The targets it checks (issue 42): top-1 >= 0.95, perplexity within 2%, decode >= 1.0x and
prefill >= 2x llama.cpp's.

usage: python bench/vs_llamacpp.py OUTDIR [GGUF ...] [--backend xnnpack] [--no-speed]
       (no GGUF: the embedded SmolLM2 Q4_1; llama.cpp from /tmp/llamacpp-venv, see README)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import others  # noqa: E402

EDGELLM = str(Path(sys.executable).parent / "edgellm")
TOKENS = 128

SCRIPT = r"""
import json, sys
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=512, n_threads=2, verbose=False)
ids = llm.tokenize(a["text"].encode(), add_bos=False, special=False)
rows = []
for tok in a["ids"][:-1]:
    llm.eval([tok])
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    rows.append(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy())
np.save(a["out"], np.stack(rows))
print(json.dumps(dict(ids=ids)))
"""


def export(gguf: str, dest: Path, backend: str, options=(), max_seq_len: int = TOKENS) -> dict:
    """`edgellm export` of `gguf` with its default recipe, or `options`; report.json."""
    cmd = [EDGELLM, "export", gguf, "--backend", backend, "--max-seq-len", str(max_seq_len), "-o",
           str(dest), "--force", "--quiet", "--json", *options]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1) or not (dest / "report.json").is_file():
        raise SystemExit(f"export of {gguf} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((dest / "report.json").read_text())


def program_logits(pte: Path, ids: list[int]) -> torch.Tensor:
    from edgellm.program import Program
    from edgellm.verification import run_steps

    program = Program(pte)
    one = lambda prompt: program.forward(torch.tensor([prompt]), torch.tensor([0]))  # noqa: E731
    return run_steps(program.forward, one, ids[:1], ids[1:])


def llama_cpp_logits(gguf: str, text: str, ids: list[int], tmp: Path) -> tuple:
    out = tmp / "llamacpp.npy"
    done = subprocess.run([others.LLAMACPP_PYTHON, "-c", SCRIPT, json.dumps(
        {"gguf": gguf, "text": text, "ids": ids, "out": str(out)})], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp on {gguf} failed: {done.stderr.strip().splitlines()[-1:]}")
    return torch.from_numpy(np.load(out)).float(), json.loads(done.stdout.splitlines()[-1])["ids"]


def edgellm_speed(dest: Path) -> dict:
    done = subprocess.run([EDGELLM, "bench", str(dest)], capture_output=True, text=True, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(prefill_tok_s=r["prefill_tok_s"]["64"], decode_tok_s=r["decode_tok_s"])


def compare_file(gguf: str, out: Path, backend: str, speed: bool) -> dict:
    from edgellm.sources.base import load_tokenizer
    from edgellm.sources import load_source
    from edgellm.verification import TEXT, perplexity, transformers_model

    dest = out / f"{backend}-{Path(gguf).stem}"
    report = export(gguf, dest, backend)
    text = TEXT.read_text()
    full = load_tokenizer(dest).encode(text).ids
    ids = full[:TOKENS]
    cpp, cpp_full = llama_cpp_logits(gguf, text, ids, dest)
    mine = program_logits(dest / "model.pte", ids)
    with torch.no_grad():
        ref = transformers_model(load_source(gguf))(torch.tensor([ids])).logits[0, :-1].float()
    first_diff = next((i for i, (a, b) in enumerate(zip(full, cpp_full)) if a != b),
                      None if len(full) == len(cpp_full) else min(len(full), len(cpp_full)))
    quant = report.get("quantization") or {}
    row = dict(file=Path(gguf).name, gguf_mb=round(Path(gguf).stat().st_size / 1e6, 1),
               backend=backend, recipe=" ".join(f"{k} {quant[k]}" for k in ("recipe", "group_size", "embeddings")
                              if quant.get(k)) or report["dtype"],
               pte_mb=round(report["pte_bytes"] / 1e6, 1),
               verified=all(c["passed"] for c in report["verify"]["checks"]),
               tokens_equal=first_diff is None, first_token_difference=first_diff,
               top1_vs_llamacpp=round(float((mine.argmax(-1) == cpp.argmax(-1)).float().mean()), 3),
               top1_vs_fp32=round(float((mine.argmax(-1) == ref.argmax(-1)).float().mean()), 3),
               llamacpp_top1_vs_fp32=round(float((cpp.argmax(-1) == ref.argmax(-1)).float().mean()), 3),
               perplexity=round(perplexity(mine, ids), 2),
               llamacpp_perplexity=round(perplexity(cpp, ids), 2),
               fp32_perplexity=round(perplexity(ref, ids), 2))
    row["size_ratio"] = round(row["pte_mb"] / row["gguf_mb"], 2)
    row["perplexity_ratio"] = round(row["perplexity"] / row["llamacpp_perplexity"], 3)
    if speed:
        mine_speed, cpp_speed = edgellm_speed(dest), others.llama_cpp(gguf)
        row.update(prefill_tok_s=mine_speed["prefill_tok_s"], decode_tok_s=mine_speed["decode_tok_s"],
                   llamacpp_prefill_tok_s=cpp_speed.get("prefill_tok_s"),
                   llamacpp_decode_tok_s=cpp_speed.get("decode_tok_s"))
        if cpp_speed.get("ok"):
            row["prefill_x"] = round(row["prefill_tok_s"] / row["llamacpp_prefill_tok_s"], 2)
            row["decode_x"] = round(row["decode_tok_s"] / row["llamacpp_decode_tok_s"], 2)
    return row


def print_table(r: dict):
    print(f"\n{r['file']} ({r['gguf_mb']} MB), {r['backend']}: {r['recipe']}, "
          f"{r['pte_mb']} MB ({r['size_ratio']}x), {'verified' if r['verified'] else 'NOT verified'}; "
          f"token ids {'equal llama.cpp' + chr(39) + 's' if r['tokens_equal'] else 'differ from token ' + str(r['first_token_difference'])}")
    print("| engine | top-1 vs llama.cpp | top-1 vs fp32 | perplexity (fp32) | prefill tok/s (64) | decode tok/s |")
    print("|---|---|---|---|---|---|")
    print(f"| edgellm | **{r['top1_vs_llamacpp']}** | {r['top1_vs_fp32']} | {r['perplexity']} "
          f"({r['perplexity_ratio']}x llama.cpp's) | {r.get('prefill_tok_s')} ({r.get('prefill_x')}x) | "
          f"{r.get('decode_tok_s')} ({r.get('decode_x')}x) |")
    print(f"| llama.cpp | | {r['llamacpp_top1_vs_fp32']} | {r['llamacpp_perplexity']} "
          f"({r['fp32_perplexity']}) | {r.get('llamacpp_prefill_tok_s')} | {r.get('llamacpp_decode_tok_s')} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("gguf", nargs="*")
    p.add_argument("--backend", default="xnnpack")
    p.add_argument("--no-speed", dest="speed", action="store_false")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [compare_file(g, out, a.backend, a.speed) for g in a.gguf or [others.smollm2_gguf()]]
    for r in rows:
        print_table(r)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
