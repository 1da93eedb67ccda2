"""4-bit from float weights (issue 42, item 8): edgellm's 4-bit recipes on a float model beside
llama.cpp's Q4_K_M of the same float file, in one run.

The only real model here, SmolLM2-135M, ships as a Q4_1 (its table Q8_0). Its dequantized weights
lie on Q4_1's grid, which would flatter any recipe that uses that grid; so the float model is
those weights with each one moved by uniform noise of half its block's step (`dither`): the
rounding error a 4-bit quantizer leaves, put back at random, the real model's statistics (scales,
outlier channels, the 49,152-row table) otherwise kept. llama.cpp's own quantizer writes its
Q4_K_M from that F32 file; edgellm exports the same F32 file with each recipe of RECIPES.

First, which linears lose most on Q4_1's grid (`sensitivity`, transformers in eager). Then,
along the whole shipped text (edgellm/data/perplexity.txt, one token per call): each program's
size over llama.cpp's file, its perplexity over llama.cpp's, and top-1 agreement with llama.cpp's
logits and with transformers' fp32 ones. The target: within 3% of llama.cpp's perplexity at no
more than 1.15x its bytes.

usage: python bench/from_float.py OUTDIR [--float F32.gguf]   (llama.cpp venv: bench/README.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import others  # noqa: E402
import vs_llamacpp  # noqa: E402
from requantize_gguf import SCRIPT as QUANTIZE  # noqa: E402

RECIPES = {  # name -> edgellm export options
    "8da4w, group 32 (llama.cpp's mix)": ["--quantize", "8da4w", "--group-size", "32",
                                          "--embedding-quantize", "4,32"],
    "8da4w, group 64 (torchao's, symmetric)": ["--quantize", "8da4w", "--group-size", "64",
                                               "--embedding-quantize", "4,32"],
}


def dither(source: str, out: Path) -> Path:
    """An F32 GGUF of `source` with every Q4_0 / Q4_1 / Q8_0 weight moved by uniform noise of
    half its block's step (seeded), the metadata as it was."""
    import gguf
    import numpy as np

    reader, kinds = gguf.GGUFReader(source), gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY and len(f.types) > 1 \
                else None
            writer.add_key_value(name, f.contents(), f.types[0], sub)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        levels = {kinds.Q4_0: 15, kinds.Q4_1: 15, kinds.Q8_0: 254}.get(t.tensor_type)
        if levels:
            blocks = x.reshape(-1, 32)
            step = (blocks.max(1, keepdims=True) - blocks.min(1, keepdims=True)) / levels
            x = (blocks + (rng.random(blocks.shape, dtype=np.float32) - 0.5) * step
                 ).reshape(x.shape)
        writer.add_tensor(t.name, x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_q4_k_m(source: Path, out: Path) -> Path:
    import subprocess

    done = subprocess.run([others.LLAMACPP_PYTHON, "-c", QUANTIZE, str(source), str(out),
                           "Q4_K_M"], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp's quantizer failed: {done.stderr.strip()[-300:]}")
    return out


def sensitivity(source: Path) -> None:
    """Which linears lose most on Q4_1's grid: transformers on the float file with the linears of
    one kind (v_proj, down_proj, ...) alone put on it, float activations, along the shipped text:
    perplexity over fp32's, per million weights of that kind."""
    import re

    from edgellm.quantize.grid import onto_q4_1
    from edgellm.sources import load_source
    from edgellm.verification import TEXT, perplexity, transformers_model

    src = load_source(str(source))
    ids, model = src.tokenizer().encode(TEXT.read_text()).ids, transformers_model(src)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()
               if p.ndim == 2 and re.search(r"\.layers\.\d+\.", n)}

    def along() -> float:
        with torch.no_grad():
            return perplexity(model(torch.tensor([ids])).logits[0, :-1].float(), ids)

    base = along()
    print(f"\n| linears on Q4_1's grid, the rest float | weights | perplexity (fp32 {base:.3f}) "
          "| + % | + % per M weights |\n|---|---|---|---|---|")
    for kind in sorted({n.split(".")[-2] for n in weights}):
        with torch.no_grad():
            for n, w in weights.items():
                model.get_parameter(n).data.copy_(onto_q4_1(w) if n.split(".")[-2] == kind else w)
        p, count = along(), sum(w.numel() for n, w in weights.items()
                                     if n.split(".")[-2] == kind) / 1e6
        print(f"| {kind} | {count:.1f}M | {p:.3f} | {100 * (p / base - 1):.2f} | "
              f"{100 * (p / base - 1) / count:.3f} |", flush=True)


def main(argv=None):
    from edgellm.numerics import compare
    from edgellm.sources.base import load_tokenizer
    from edgellm.sources import load_source
    from edgellm.verification import TEXT, perplexity, transformers_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--float", help="a float GGUF (default: the embedded SmolLM2, dithered)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    source = Path(a.float) if a.float else dither(others.smollm2_gguf(), out / "float.gguf")
    sensitivity(source)
    theirs = llama_cpp_q4_k_m(source, out / "Q4_K_M.gguf")
    text, rows = TEXT.read_text(), []
    for name, options in RECIPES.items():
        dest = out / name.split(",")[1].split("(")[0].strip().replace(" ", "-")
        report = vs_llamacpp.export(str(source), dest, "xnnpack", options, max_seq_len=512)
        ids = load_tokenizer(dest).encode(text).ids
        if not rows:
            cpp, _ = vs_llamacpp.llama_cpp_logits(str(theirs), text, ids, out)
            with torch.no_grad():
                ref = transformers_model(load_source(str(source)))(
                    torch.tensor([ids])).logits[0, :-1].float()
            rows.append(dict(engine="llama.cpp Q4_K_M", mb=round(theirs.stat().st_size / 1e6, 1),
                             perplexity=round(perplexity(cpp, ids), 3),
                             top1_vs_fp32=round(compare(cpp, ref).argmax_agree, 3),
                             fp32_perplexity=round(perplexity(ref, ids), 3), tokens=len(ids)))
        mine = vs_llamacpp.program_logits(dest / "model.pte", ids)
        rows.append(dict(engine=f"edgellm {name}", mb=round(report["pte_bytes"] / 1e6, 1),
                         verified=all(c["passed"] for c in report["verify"]["checks"]),
                         perplexity=round(perplexity(mine, ids), 3),
                         top1_vs_fp32=round(compare(mine, ref).argmax_agree, 3),
                         top1_vs_llamacpp=round(compare(mine, cpp).argmax_agree, 3)))
    base = rows[0]
    print(f"\nfloat: {source.name}, perplexity {base['fp32_perplexity']} along {base['tokens']} "
          "tokens")
    print("| engine | MB | x llama.cpp's bytes | perplexity | x llama.cpp's | top-1 vs llama.cpp "
          "| top-1 vs fp32 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['mb']} | {r['mb'] / base['mb']:.2f} | {r['perplexity']} | "
              f"{r['perplexity'] / base['perplexity']:.3f} | {r.get('top1_vs_llamacpp', '')} | "
              f"{r['top1_vs_fp32']} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
