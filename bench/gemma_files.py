"""A Gemma 3 of real shape (270M: a 262,144-token table tied to the head, 18 layers 640 wide)
with random weights, written as llama.cpp's converter writes it (tests/test_sources.py's
`write_gguf`, F32) and quantized by llama.cpp's own quantizer into the file types given; each
file exported with edgellm's default recipe on each backend given. Prints and writes
OUTDIR/gemma_files.jsonl: the program's bytes over the file's, the tensor types the file holds,
what each became (report.json's `from_source`) and the export's time and peak RSS.

usage: python bench/gemma_files.py OUTDIR [--types Q4_K_M Q4_0 Q8_0] [--backends xnnpack coreml]
       [--external-weights]   # XNNPACK: the weights in foundation.ptd (pte_bytes counts both)

Random weights say nothing of accuracy; sizes and memory are the weights' shapes and types.
Verification is off (its transformers run of a 262k vocabulary is not what is measured here).
"""

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]

VOCAB = 262_144
EDGELLM = str(Path(sys.executable).parent / "edgellm")


def gemma_270m():
    """google/gemma-3-270m's text config (its config.json, as transformers 5 reads it)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(18)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def tokenizer_json(path: Path) -> Path:
    """A byte-level BPE of VOCAB tokens (the 256 bytes, every pair of them merged, then
    distinct fillers): a table of Gemma's size whose rows are all tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [(a, b) for a in alphabet for b in alphabet]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    while len(vocab) < VOCAB - 3:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def main():
    import gguf
    import torch
    from transformers import Gemma3ForCausalLM

    from gguf_fixtures import quantize
    from test_sources import write_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0"])
    p.add_argument("--backends", nargs="+", default=["xnnpack", "coreml"])
    p.add_argument("--external-weights", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    source = out / "gemma3-270m-F32.gguf"
    if not source.exists():
        torch.manual_seed(0)
        cfg = gemma_270m()
        # special ids as the tokenizer puts them: 3 added tokens at the end of the table
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = VOCAB - 3, VOCAB - 2, VOCAB - 1
        write_gguf(Gemma3ForCausalLM(cfg).eval(), tokenizer_json(out / "tok"), source)
    rows = out / "gemma_files.jsonl"
    for kind in a.types:
        path = out / f"gemma3-270m-{kind}.gguf"
        if not path.exists():
            quantize(source, path, kind)
        types = dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))
        for backend in a.backends:
            folder = out / (f"{kind}-{backend}" + ("-external" if a.external_weights else ""))
            start = time.perf_counter()  # a process apiece: its peak RSS is the export's
            subprocess.run([EDGELLM, "export", str(path), "--backend", backend, "-o", str(folder),
                            "--no-verify", "--force", "--quiet", "--max-seq-len", "128",
                            *(["--external-weights"] if a.external_weights else [])],
                           check=True, stdout=subprocess.DEVNULL)
            report = json.loads((folder / "report.json").read_text())
            row = {"file": path.name, "file_bytes": path.stat().st_size, "tensors": types,
                   "backend": backend, "external_weights": a.external_weights,
                   "pte_bytes": report["pte_bytes"], "file_bytes_out": report["file_bytes"],
                   "ratio": round(report["pte_bytes"] / path.stat().st_size, 3),
                   "from_source": report.get("quantization", {}).get("from_source"),
                   "export_s": round(time.perf_counter() - start, 1),
                   "peak_rss_mb": report["peak_rss_mb"]}
            print(json.dumps(row), flush=True)
            with rows.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
