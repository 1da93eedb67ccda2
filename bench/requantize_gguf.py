"""Write a GGUF in another llama.cpp quantization (default Q4_K_M) with llama.cpp's own quantizer,
to export files of the types users download (K-quants) when only the embedded Q4_1 is at hand.

usage: python bench/requantize_gguf.py OUT.gguf [--source IN.gguf] [--type Q4_K_M]

Runs llama-cpp-python's `llama_model_quantize` in its own venv (others.py's LLAMACPP_PYTHON; the
error says how to create it), `allow_requantize` on: from an already-quantized source the result
holds that source's error plus the new one, which is fine for checking what edgellm keeps.
"""

import argparse
import subprocess
from pathlib import Path

from others import LLAMACPP_PYTHON, smollm2_gguf

SCRIPT = """
import ctypes, sys, llama_cpp
src, out, kind = sys.argv[1:]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.allow_requantize, p.nthread = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + kind), True, 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(p)))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--source", help="default: the embedded SmolLM2-135M Q4_1")
    p.add_argument("--type", default="Q4_K_M", help="llama.cpp's file type name, e.g. Q4_K_M")
    a = p.parse_args()
    if not Path(LLAMACPP_PYTHON).exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} not found: see bench/others.py (llama_cpp)")
    source = a.source or str(smollm2_gguf())
    done = subprocess.run([LLAMACPP_PYTHON, "-c", SCRIPT, source, a.out, a.type],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's quantizer failed ({done.returncode}): "
                         f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    print(a.out)


if __name__ == "__main__":
    main()
