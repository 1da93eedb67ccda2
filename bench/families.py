"""The families of issue 19 at real shapes, and every family on every backend at tiny ones.

usage: python bench/families.py make NAME OUTDIR [--seed 0]   # a real-shape random checkpoint
       python bench/families.py caches [--max-seq-len 128]    # state bytes at 4k and 32k context
       python bench/families.py matrix OUTDIR                 # every family x backend, tiny

NAME: lfm3-1.7b (transformers' Lfm3Config defaults, its LFM3-1.7B shape), gemma3-1b (Gemma 3 1B's
published config: 26 layers, 5 sliding-window layers of 512 to each global one), phi-4-mini
(ExecuTorch's phi_4_mini params, ../shared/reference/executorch-params/, with its LongRoPE
factors). Weights are transformers' initialization with a fixed seed, saved as fp32 safetensors.

`caches` counts what a program keeps between calls, as edgellm builds it (ring buffers of
window + max_seq_len - 1 slots for sliding-window layers, llama.layer_windows and
cache.ring_slots), against full-length caches in every attention layer. `matrix` exports the
tiny checkpoint of every family (tests/conftest.py) to XNNPACK, Core ML and Vulkan and prints
the delegation of each, verified.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PARAMS = HERE.parent.parent / "shared" / "reference" / "executorch-params"


def config(name: str):
    from transformers import Gemma3TextConfig, Lfm3Config, Phi3Config

    if name == "lfm3-1.7b":
        return Lfm3Config()
    if name == "gemma3-1b":
        return Gemma3TextConfig(
            vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
            query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}},
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if name == "phi-4-mini":
        p = json.loads((PARAMS / "phi_4_mini_config.json").read_text())
        return Phi3Config(
            vocab_size=p["vocab_size"], hidden_size=p["dim"], intermediate_size=p["hidden_dim"],
            num_hidden_layers=p["n_layers"], num_attention_heads=p["n_heads"],
            num_key_value_heads=p["n_kv_heads"], max_position_embeddings=131072,
            original_max_position_embeddings=4096, rms_norm_eps=p["norm_eps"],
            tie_word_embeddings=True, bos_token_id=199999, eos_token_id=199999,
            pad_token_id=199999,
            rope_parameters={"rope_type": "longrope", "rope_theta": p["rope_theta"],
                             "partial_rotary_factor": p["partial_rotary_factor"],
                             "short_factor": p["rope_scaling_short_factor"],
                             "long_factor": p["rope_scaling_long_factor"],
                             "original_max_position_embeddings": 4096})
    raise SystemExit(f"unknown NAME {name}: lfm3-1.7b, gemma3-1b, phi-4-mini")


def make(name: str, out: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(name), dtype=torch.float32)
    model.save_pretrained(out)
    print(f"{out}: {sum(t.numel() for t in model.parameters()) / 1e9:.2f} B parameters")


def state_bytes(cfg, context: int, max_seq_len: int, bytes_per: int = 4) -> tuple[int, int]:
    """(bytes edgellm's program keeps, bytes with full-length caches in every attention layer)."""
    from edgellm.architectures.cache import ring_slots
    from edgellm.architectures.layers import ModelOptions
    from edgellm.architectures.llama import head_dim, layer_windows

    opts = ModelOptions(context, max_call_len=max_seq_len)
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    per_slot = 2 * cfg.num_key_value_heads * head_dim(cfg) * bytes_per  # k and v
    ours = full = 0
    for kind, window in zip(kinds, layer_windows(cfg)):
        if kind == "conv":
            ours += (cfg.conv_L_cache - 1) * cfg.hidden_size * bytes_per
            continue
        ours += ring_slots(window, opts) * per_slot
        full += context * per_slot
    return ours, full


def caches(max_seq_len: int) -> None:
    rows = []
    print(f"{'model':12} {'context':>8} {'edgellm MB':>11} {'all full MB':>12} {'ratio':>6}")
    for name in ("lfm3-1.7b", "gemma3-1b", "phi-4-mini"):
        cfg = config(name)
        for context in (4096, 32768):
            ours, full = state_bytes(cfg, context, max_seq_len)
            rows.append({"model": name, "context": context, "state_bytes": ours,
                         "full_cache_bytes": full, "ratio": round(ours / full, 4)})
            print(f"{name:12} {context:>8} {ours / 1e6:>11.1f} {full / 1e6:>12.1f} "
                  f"{ours / full:>6.3f}")
    print(json.dumps(rows))


def matrix(out: str) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import edgellm
    from conftest import FAMILIES, LONG, make_tokenizer, save_model, tiny_family_configs

    root = Path(out)
    vocab = make_tokenizer(root / "tok")
    rows = []
    for family in FAMILIES:
        folder = root / family
        if not (folder / "config.json").is_file():
            save_model(tiny_family_configs(vocab)[family], folder)
        for backend in ("xnnpack", "coreml", "vulkan"):
            report = edgellm.export(str(folder), output=str(root / f"{family}-{backend}"),
                                    backends=backend, force=True, quiet=True, **LONG)
            d = report["methods"]["forward"]["delegation"]
            rows.append({"family": family, "backend": backend, "subgraphs": d["subgraphs"],
                         "non_delegated_compute": d["non_delegated_compute_nodes"],
                         "verified": report["verify"]["passed"], "wall_s": report["wall_s"]})
            print(f"{family:12} {backend:8} subgraphs {d['subgraphs']:>2}  non-delegated compute "
                  f"{d['non_delegated_compute_nodes']:>3}  verified {report['verify']['passed']}"
                  f"  {report['wall_s']:.1f} s", flush=True)
    print(json.dumps(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("name"), m.add_argument("out"), m.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("caches")
    c.add_argument("--max-seq-len", type=int, default=128)
    x = sub.add_parser("matrix")
    x.add_argument("out")
    a = p.parse_args()
    if a.cmd == "make":
        make(a.name, a.out, a.seed)
    elif a.cmd == "caches":
        caches(a.max_seq_len)
    else:
        matrix(a.out)


if __name__ == "__main__":
    main()
