#!/usr/bin/env bash
# Long contexts side by side (issue 22): SmolLM2-135M (the embedded GGUF, dequantized once to a
# Hugging Face folder so both tools read the same weights), 8da4w with 4-bit embeddings at
# max_context_len 4096, fp32 and int8 KV caches, exported by edgellm and by ExecuTorch's export_llm
# (its `quantize_kv_cache`), then prefill and decode by context depth, interleaved in one process
# (bench/depth.py). export_llm runs from its own venv (../shared/bench/anchor.sh installs it).
#
# usage: bench/depth_vs_anchor.sh OUTDIR [DEPTHS]      (default depths 0,1024,2048,4000)
#   env SKIP_EXPORT=1: measure the programs already in OUTDIR; SKIP_ANCHOR=1: export edgellm's
#   only
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: depth_vs_anchor.sh OUTDIR [DEPTHS]}; depths=${2:-0,1024,2048,4000}
mkdir -p "$out"; out=$(cd "$out" && pwd)
py=${EDGELLM_PYTHON:-$here/../.venv/bin/python}
venv=${ANCHOR_VENV:-/tmp/edgellm-anchor-venv}
[ -x "$venv/bin/python" ] || { python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0 executorch==1.5.1 safetensors transformers; }
ctx=4096 group=32

# the GGUF dequantized by edgellm's GGUF source (llama.cpp's q/k permutation undone) into a
# Hugging Face folder; export_llm reads the same tensors as a Meta checkpoint in HF rotary order
# (use_hf_rope), names as ExecuTorch's smollm2 converter gives them, the tied head written out
[ -f "$out/hf/config.json" ] || "$py" - "$out" "$here" <<'PY'
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from edgellm.sources import load_source
out, here = Path(sys.argv[1]), Path(sys.argv[2])
source = load_source(None)  # the embedded SmolLM2-135M-Instruct GGUF
model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32)
loaded = model.load_state_dict({k: v.float() for k, v in source.state_dict.items()},
                               strict=False)
assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}, loaded
model.tie_weights()
model.save_pretrained(out / "hf")
source.write_tokenizer(out / "hf")
names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
         "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
         "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
         "mlp.up_proj": "feed_forward.w3"}
sd = {}
for key, value in model.state_dict().items():
    if key.startswith("model.layers."):
        _, _, i, rest = key.split(".", 3)
        module, _, kind = rest.rpartition(".")
        sd[f"layers.{i}.{names[module]}.{kind}"] = value
sd["tok_embeddings.weight"] = model.model.embed_tokens.weight.detach().clone()
sd["norm.weight"] = model.model.norm.weight.detach()
sd["output.weight"] = sd["tok_embeddings.weight"]
torch.save(sd, out / "anchor.pth")
params = json.load(open(here.parents[1] / "shared/reference/executorch-params/"
                        "smollm2_135M_config.json"))
json.dump({**params, "use_hf_rope": True}, open(out / "params.json", "w"), indent=2)
PY

anchor() {  # NAME [extra export_llm overrides]
  local name=$1; shift
  ( cd "$out" && /usr/bin/time -v "$venv/bin/python" -m executorch.extension.llm.export.export_llm \
      ++base.model_class=smollm2 ++base.params="$out/params.json" ++base.checkpoint="$out/anchor.pth" \
      ++model.use_kv_cache=True ++model.use_sdpa_with_kv_cache=True ++model.enable_dynamic_shape=True \
      ++quantization.qmode=8da4w ++quantization.group_size=$group ++quantization.embedding_quantize=\'4,$group\' \
      ++backend.xnnpack.enabled=True ++backend.xnnpack.extended_ops=True \
      ++export.max_seq_length=128 ++export.max_context_length=$ctx \
      ++export.output_name="$name.pte" "$@" ) > "$out/$name.log" 2>&1
}
ours() {  # NAME [extra edgellm flags]
  local name=$1; shift
  /usr/bin/time -v "$py" -m edgellm.cli export "$out/hf" -o "$out/$name" --force --quantize 8da4w \
      --group-size $group --embedding-quantize 4,$group --max-context-len $ctx "$@" \
      > "$out/$name.log" 2>&1 || true  # a 4-bit requantization may miss verify's bounds (exit 1)
}
if [ "${SKIP_EXPORT:-0}" != 1 ]; then
  if [ "${SKIP_ANCHOR:-0}" != 1 ]; then
    anchor export_llm_fp32
    anchor export_llm_int8 ++model.quantize_kv_cache=True
  fi
  ours edgellm_fp32
  ours edgellm_int8 --kv-cache int8
fi
for n in export_llm_fp32 export_llm_int8 edgellm_fp32 edgellm_int8; do
  echo "$n: $(grep -E 'Elapsed|Maximum resident' "$out/$n.log" | tr -s ' \t' ' ' | tr '\n' ';')"
done
cd "$here" && "$py" depth.py --depths "$depths" \
    export_llm_fp32="$out/export_llm_fp32.pte" edgellm_fp32="$out/edgellm_fp32/model.pte" \
    export_llm_int8="$out/export_llm_int8.pte" edgellm_int8="$out/edgellm_int8/model.pte"
