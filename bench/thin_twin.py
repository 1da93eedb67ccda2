"""A GGUF's thin twin: the same family, layer count, vocabulary and file type, 64 wide, random
weights, written as llama.cpp's converter writes it and quantized by llama.cpp's own quantizer.
Its export's peak is the toolchain's cost for that program's graph with almost no weights: what
export_matrix.py's `--twins` puts beside each file as its fixed cost.

usage: python bench/thin_twin.py SOURCE.gguf OUT.gguf [--width 64]

The twin keeps what sets the graph (layers, their kinds, the table's rows, tied or not); its
heads are 16 wide (4 of them, the source's key-value grouping where it divides 4). Its tensors
are narrower than llama.cpp's 256-value blocks, so a K-quant file's twin holds llama.cpp's
fallbacks (Q5_0, Q8_0), which edgellm puts on the same grids and linears.
"""

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]


def file_type(path: Path) -> str:
    """The llama.cpp file type name (Q4_K_M, Q8_0, ...) a GGUF says it was written as."""
    import gguf

    field = gguf.GGUFReader(path).fields["general.file_type"]
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


def thin_config(cfg, width: int):
    """`cfg` with every width `width` (heads of 16) and all else kept."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    kv = cfg.num_key_value_heads if 4 % cfg.num_key_value_heads == 0 else 1
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = width, 3 * width, 16
    cfg.num_attention_heads, cfg.num_key_value_heads = 4, kv
    if hasattr(cfg, "query_pre_attn_scalar"):
        cfg.query_pre_attn_scalar = 16
    return cfg


def main():
    import torch
    from transformers import AutoModelForCausalLM

    from edgellm.sources.gguf import load_gguf
    from gguf_fixtures import quantize
    from test_sources import write_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--width", type=int, default=64)
    a = p.parse_args()
    source = load_gguf(Path(a.source), lazy=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(thin_config(source.hf_config, a.width)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        if not source.write_tokenizer(Path(tmp)):
            raise SystemExit(f"{a.source}: no tokenizer.json to write the twin with")
        f32 = Path(tmp) / "twin-F32.gguf"
        write_gguf(hf, Path(tmp) / "tokenizer.json", f32)
        quantize(f32, Path(a.out), file_type(Path(a.source)))
    print(a.out)


if __name__ == "__main__":
    main()
