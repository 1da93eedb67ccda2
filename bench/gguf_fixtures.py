"""The GGUF test fixtures in tests/data/gguf/, written by llama.cpp's own quantizer: a tiny random
model per family that reads GGUF, as llama.cpp's converter lays it out (tests/test_sources.py's
`write_gguf`, in F32), then quantized by llama.cpp into the file types users download.

usage: python bench/gguf_fixtures.py [--out tests/data/gguf]

Widths (tests/test_sources.py's `fixture_config`) are chosen so that the files hold what real
ones do: 256-wide rows (the K-quants' super block) in the attention and up/gate projections and
the tables, 320-wide rows (a multiple of 32, not of 256) in the down projections, where llama.cpp
falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; the Q2_K and Q3_K_M mixes
to Q4_0 and Q5_0). Llama gets every type of FULL; every other family the types of SOME. llama.cpp runs from its own venv (bench/README.md); the suite only reads the
files. manifest.json records each file's family, type, tensor types and the llama.cpp version.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE)]

from others import LLAMACPP_PYTHON  # noqa: E402
from requantize_gguf import SCRIPT  # noqa: E402

FULL = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M",
        "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
SOME = ("Q4_K_M",)
FAMILIES = ("llama", "qwen2", "qwen3", "lfm2", "gemma3_text", "phi3", "granite", "olmo2",
            "smollm3", "lfm2_moe", "qwen3_moe")
def quantize(source: Path, out: Path, kind: str) -> None:
    done = subprocess.run([LLAMACPP_PYTHON, "-c", SCRIPT, str(source), str(out), kind],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's quantizer failed on {out.name} ({done.returncode}): "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")


def main():
    import gguf

    from conftest import make_tokenizer, random_model
    from test_sources import fixture_config, write_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE.parent / "tests" / "data" / "gguf"))
    a = p.parse_args()
    if not Path(LLAMACPP_PYTHON).exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} not found: see bench/README.md (llama.cpp)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([LLAMACPP_PYTHON, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    manifest = {"llama_cpp_python": version, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab = make_tokenizer(tmp / "tok")
        shutil.copy(tmp / "tok" / "tokenizer.json", out / "tokenizer.json")
        for family in FAMILIES:
            source = tmp / f"{family}-F32.gguf"
            write_gguf(random_model(fixture_config(family, vocab)), tmp / "tok" / "tokenizer.json",
                       source)
            for kind in FULL if family == "llama" else SOME:
                path = out / f"{family}-{kind}.gguf"
                quantize(source, path, kind)
                types = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
                manifest["files"][path.name] = {"family": family, "type": kind,
                                                "tensors": dict(sorted(types.items()))}
                print(f"{path.name:28} {path.stat().st_size:>9,} B  {dict(types)}")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({"files": len(manifest["files"]),
                      "bytes": sum(f.stat().st_size for f in out.glob("*.gguf"))}))


if __name__ == "__main__":
    main()
