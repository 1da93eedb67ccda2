"""A random-weight checkpoint in Hugging Face layout from ExecuTorch parameters, for export
benchmarks at sizes and architectures the anchor does not build (LFM2.5-1.2B, Qwen3-0.6B).

usage: python bench/make_checkpoint.py PARAMS.json MODEL_CLASS OUTDIR [--seed 0] [--tied]
e.g.   python bench/make_checkpoint.py \\
           ../shared/reference/executorch-lfm2-params/lfm2_5_1_2b_config.json lfm2_5_1_2b /tmp/lfm2_5_1_2b
       python bench/make_checkpoint.py bench/params/qwen3_0_6b_config.json qwen3_0_6b \\
           /tmp/qwen3/hf --tied

The config comes from edgellm's own params reader (the same one `base.params` goes through);
weights are transformers' initialization with a fixed seed, saved as fp32 safetensors. `--tied`
ties the head to the embedding (LFM2 always is; Qwen3-0.6B is too). bench/params/ holds params
ExecuTorch's wheel does not ship (its examples/models/qwen3/config/0_6b_config.json, as upstream).
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from edgellm.sources.executorch import hf_config_from_params


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("params"), p.add_argument("model_class"), p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action="store_true", help="head tied to the embedding")
    a = p.parse_args()
    config = hf_config_from_params(json.loads(Path(a.params).read_text()), a.model_class,
                                   tie_word_embeddings=a.tied)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(a.out)
    print(f"{a.out}: {sum(t.numel() for t in model.parameters()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
