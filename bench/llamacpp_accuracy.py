"""How far llama.cpp's own 4-bit execution of the SmolLM2 GGUF is from fp32, on the same measure
edgellm's verify uses: along the shipped text (edgellm/data/perplexity.txt, 128 tokens through the
GGUF's tokenizer, one token per call from position 0), SQNR of the logits, top-1 agreement and
perplexity against transformers in fp32 on the dequantized weights. Context for edgellm's 4-bit
recipes, which keep the file's 4-bit grid and run 8-bit dynamic activations.

usage: python bench/llamacpp_accuracy.py [GGUF]     (llama.cpp from /tmp/llamacpp-venv, see README)
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import others  # noqa: E402

SCRIPT = r"""
import json, sys
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=512, n_threads=2, logits_all=True, verbose=False)
rows = []
for i, tok in enumerate(a["ids"][:-1]):
    llm.eval([tok])
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    rows.append(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy())
np.save(a["out"], np.stack(rows))
"""


def main():
    from edgellm.numerics import compare
    from edgellm.sources import load_source
    from edgellm.verification import TEXT, perplexity, transformers_model

    gguf = sys.argv[1] if len(sys.argv) > 1 else others.smollm2_gguf()
    source = load_source(gguf)
    with tempfile.TemporaryDirectory() as tmp:
        source.write_tokenizer(Path(tmp))
        from edgellm.runtime import load_tokenizer

        ids = load_tokenizer(Path(tmp)).encode(TEXT.read_text()).ids[:128]
        with torch.no_grad():
            ref = transformers_model(source)(torch.tensor([ids])).logits[0, :-1].float()
        out = Path(tmp) / "logits.npy"
        subprocess.run([others.LLAMACPP_PYTHON, "-c", SCRIPT,
                        json.dumps({"gguf": gguf, "ids": ids, "out": str(out)})], check=True)
        cpp = torch.from_numpy(np.load(out)).float()
    c = compare(cpp, ref)
    result = {"engine": "llama.cpp", "weights": Path(gguf).name, "tokens": len(ids),
              "sqnr_db": round(c.sqnr_db, 1),
              "top1": round(float((cpp.argmax(-1) == ref.argmax(-1)).float().mean()), 3),
              "perplexity": round(perplexity(cpp, ids), 2),
              "perplexity_fp32": round(perplexity(ref, ids), 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
