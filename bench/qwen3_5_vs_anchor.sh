#!/usr/bin/env bash
# edgellm beside ExecuTorch's export_llm on a random Qwen3.5-0.8B (max_seq_len 512): export_llm's
# own qwen3_5_xnnpack_fp32.yaml (fp32, static shapes: a prompt goes in one token per call) and
# edgellm's fp32 (T dynamic: a prompt is one call), then edgellm's 8da4w, which export_llm does
# not make, verified against the fp32 checkpoint.
#
# usage: bench/qwen3_5_vs_anchor.sh OUTDIR
#   env ANCHOR_VENV: export_llm's venv (default /tmp/edgellm-anchor-venv, as
#   ../shared/bench/anchor.sh installs it; run that first if it is missing)
#   env SKIP_ANCHOR=1 reuses an earlier export_llm run's program and log
# OUTDIR/hf (bench/make_checkpoint.py on ExecuTorch's qwen3_5_0_8b params, seed 0, tied) and
# OUTDIR/anchor.pth (ExecuTorch's qwen3_5 convert_weights) are reused if present. Writes
# OUTDIR/anchor.jsonl, OUTDIR/edgellm.jsonl and OUTDIR/edgellm_q8da4w.jsonl, prints the export
# table, the 8da4w export's verification, then both fp32 programs' speed interleaved over 5
# rounds (speed_vs_anchor.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${1:?usage: qwen3_5_vs_anchor.sh OUTDIR}
py=${EDGELLM_PYTHON:-$root/.venv/bin/python}
venv=${ANCHOR_VENV:-/tmp/edgellm-anchor-venv}
params="$root/../shared/reference/executorch-params/qwen3_5_0_8b_config.json"
mkdir -p "$out"; out=$(cd "$out" && pwd)
. "$here/anchor_family.sh"
anchor_family "$out" "$params" qwen3_5_0_8b qwen3_5 qwen3_5_xnnpack_fp32.yaml \
    anchor_xnnpack_fp32.pte
# a label not starting with "xnnpack": the summaries' own speed probe sends a 64-token prompt in
# one call, which a static-shape program refuses; speed_vs_anchor.py below measures both
"$venv/bin/python" "$root/../shared/bench/anchor_lib.py" summarize qwen3_5_fp32 \
    "$out/anchor.log" "$out/anchor_xnnpack_fp32.pte" > "$out/anchor.jsonl"
/usr/bin/time -v "$py" -m edgellm.cli export "$out/hf" -o "$out/edgellm_xnnpack_fp32" --force \
    --backend xnnpack --max-seq-len 512 --max-context-len 512 --no-verify --quiet \
    > "$out/edgellm.log" 2>&1
"$py" "$here/summarize.py" qwen3_5_fp32 "$out/edgellm_xnnpack_fp32" "$out/edgellm.log" \
    > "$out/edgellm.jsonl"
"$py" "$here/summarize.py" --table "$out/anchor.jsonl" "$out/edgellm.jsonl"
# 1: written, verification failed (random weights at 4 bits flatten the logits; the figures stand)
/usr/bin/time -v "$py" -m edgellm.cli export "$out/hf" -o "$out/edgellm_xnnpack_q8da4w" --force \
    --backend xnnpack --quantize 8da4w --max-seq-len 512 --max-context-len 512 --quiet \
    > "$out/edgellm_q8da4w.log" 2>&1 || [ $? = 1 ]
"$py" "$here/summarize.py" qwen3_5_q8da4w "$out/edgellm_xnnpack_q8da4w" "$out/edgellm_q8da4w.log" \
    > "$out/edgellm_q8da4w.jsonl"
"$py" -c "
import json, sys
r = json.load(open('$out/edgellm_xnnpack_q8da4w/report.json'))
print(json.dumps({'verify': r['verify']['checks'], 'perplexity': r['verify'].get('perplexity')}))"
"$py" "$here/speed_vs_anchor.py" "$out/anchor_xnnpack_fp32.pte" "$out/edgellm_xnnpack_fp32" \
    --rounds 5
