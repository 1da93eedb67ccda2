"""A random-weight LFM2 checkpoint in Hugging Face layout from ExecuTorch parameters, for export
benchmarks at sizes the anchor does not build (e.g. LFM2.5-1.2B).

usage: python bench/make_lfm2_checkpoint.py PARAMS.json MODEL_CLASS OUTDIR [--seed 0]
e.g.   python bench/make_lfm2_checkpoint.py \\
           ../shared/reference/executorch-lfm2-params/lfm2_5_1_2b_config.json lfm2_5_1_2b /tmp/lfm2_5_1_2b

The config comes from edgellm's own params reader (the same one `base.params` goes through);
weights are transformers' initialization with a fixed seed, saved as fp32 safetensors.
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
    a = p.parse_args()
    config = hf_config_from_params(json.loads(Path(a.params).read_text()), a.model_class)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(a.out)
    print(f"{a.out}: {sum(t.numel() for t in model.parameters()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
