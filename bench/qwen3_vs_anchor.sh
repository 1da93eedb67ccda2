#!/usr/bin/env bash
# edgellm beside ExecuTorch's export_llm on a random Qwen3-0.6B (max_seq_len 512), 8da4w with
# 8-bit embeddings: ExecuTorch's own examples/models/qwen3/config/qwen3_xnnpack_q8da4w.yaml.
#
# usage: bench/qwen3_vs_anchor.sh OUTDIR
#   env ANCHOR_VENV: export_llm's venv (default /tmp/edgellm-anchor-venv, as
#   ../shared/bench/anchor.sh installs it; run that first if it is missing); SKIP_ANCHOR=1
#   reuses an earlier export_llm run's program and log
# OUTDIR/hf (bench/make_checkpoint.py, seed 0, tied) and OUTDIR/anchor.pth (ExecuTorch's qwen3
# convert_weights) are reused if present. Writes OUTDIR/anchor.jsonl and OUTDIR/edgellm.jsonl,
# prints the export table (its speed rows: one measurement each, in summarize.py's process), then
# the interleaved speed of both programs over 5 rounds (speed_vs_anchor.py), which BENCHMARKS.md
# reports.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${1:?usage: qwen3_vs_anchor.sh OUTDIR}
py=${EDGELLM_PYTHON:-$root/.venv/bin/python}
venv=${ANCHOR_VENV:-/tmp/edgellm-anchor-venv}
params="$here/params/qwen3_0_6b_config.json"
mkdir -p "$out"; out=$(cd "$out" && pwd)
. "$here/anchor_family.sh"
anchor_family "$out" "$params" qwen3_0_6b qwen3 qwen3_xnnpack_q8da4w.yaml anchor_xnnpack_q8da4w.pte
"$venv/bin/python" "$root/../shared/bench/anchor_lib.py" summarize xnnpack_q8da4w \
    "$out/anchor.log" "$out/anchor_xnnpack_q8da4w.pte" > "$out/anchor.jsonl"
# the yaml's recipe: qmode 8da4w (group 128, HQQ scales), embedding_quantize 8,0
/usr/bin/time -v "$py" -m edgellm.cli export "$out/hf" -o "$out/edgellm_xnnpack_q8da4w" --force \
    --backend xnnpack --quantize 8da4w --embedding-quantize 8,0 --max-seq-len 512 \
    --max-context-len 512 --no-verify --quiet > "$out/edgellm.log" 2>&1
"$py" "$here/summarize.py" xnnpack_q8da4w "$out/edgellm_xnnpack_q8da4w" "$out/edgellm.log" \
    > "$out/edgellm.jsonl"
"$py" "$here/summarize.py" --table "$out/anchor.jsonl" "$out/edgellm.jsonl"
"$py" "$here/speed_vs_anchor.py" "$out/anchor_xnnpack_q8da4w.pte" "$out/edgellm_xnnpack_q8da4w" \
    --rounds 5
