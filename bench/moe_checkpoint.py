"""A real-shape random LFM2-8B-A1B in Hugging Face layout, bf16 safetensors one layer per shard
(about 17 GB), written without the model ever being in memory: for the streaming-export and
mixture-of-experts decode benchmarks (issue 23).

usage: python bench/moe_checkpoint.py OUTDIR [--layers 24] [--seed 0]

The config is transformers' `Lfm2MoeConfig` at LFM2-8B-A1B's published shape (24 layers,
attention at 2, 6, 10, 14, 18 and 21, the first 2 dense; 32 experts of 1792, 4 chosen, over a
hidden size of 2048; vocabulary 65536, tied head). Tensor names and shapes come from
transformers' own model built on the meta device; its stacked experts are written the way the
published checkpoint stores them, one tensor per expert (`feed_forward.experts.N.w1/w3/w2`).
Weights are N(0, 0.02), norms 1, expert biases N(0, 0.01) (the routing then spreads over every
expert). No tokenizer: `edgellm export ... --no-verify` and `edgellm bench` need none.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Lfm2MoeConfig

ATTENTION = (2, 6, 10, 14, 18, 21)


def config(layers: int) -> Lfm2MoeConfig:
    kinds = ["full_attention" if i in ATTENTION else "conv" for i in range(layers)]
    return Lfm2MoeConfig(num_hidden_layers=layers, layer_types=kinds, dtype="bfloat16")


def tensors(name: str, shape: torch.Size, experts: int) -> dict:
    """The checkpoint's tensors for one of transformers' parameters (experts split per expert)."""
    if name.endswith("experts.gate_up_proj"):  # (E, 2F, D) -> w1 (gate) and w3 (up) per expert
        prefix, width = name[:-len("gate_up_proj")], shape[1] // 2
        return {f"{prefix}{e}.{w}.weight": normal((width, shape[2]), 0.02)
                for e in range(experts) for w in ("w1", "w3")}
    if name.endswith("experts.down_proj"):
        prefix = name[:-len("down_proj")]
        return {f"{prefix}{e}.w2.weight": normal(shape[1:], 0.02) for e in range(experts)}
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    return {name: normal(shape, 0.01 if name.endswith("expert_bias") else 0.02)}


def normal(shape, std: float) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=torch.bfloat16).normal_(0, std)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(a.layers)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()
                  if k != "lm_head.weight"}  # tied
    groups = {}  # shard -> names: one per layer, the rest in the last
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(layer, []).append(name)
    torch.manual_seed(a.seed)
    weight_map, total = {}, 0
    for i, (layer, names) in enumerate(groups.items()):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {k: v for n in names for k, v in tensors(n, shapes[n], cfg.num_experts).items()}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
        total += sum(t.numel() for t in part.values())
        print(f"{shard}: layer {layer}, {sum(t.nbytes for t in part.values()) / 2**20:.0f} MB",
              flush=True)
        del part
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}, indent=1))
    cfg.save_pretrained(out)
    print(f"{out}: {total / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
