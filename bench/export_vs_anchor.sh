#!/usr/bin/env bash
# edgellm beside ExecuTorch's export_llm on the same LFM2.5-350M weights (max_seq_len 512).
#
# usage: bench/export_vs_anchor.sh OUTDIR [CONFIG ...]
#   CONFIG: coreml_fp32 xnnpack_fp32 xnnpack_q8da4w (export_llm's configs; edgellm runs the same
#   settings) or xnnpack_q8da4w_emb4 (edgellm only: 8da4w with 4-bit embeddings; its anchor row
#   is export_llm's xnnpack_q8da4w)
#   env SKIP_ANCHOR=1 reuses OUTDIR/anchor.jsonl from an earlier anchor run of the same session.
#   env NO_VERIFY=1 exports with --no-verify (export_llm does not verify) into
#   OUTDIR/edgellm_noverify_CONFIG and OUTDIR/edgellm_noverify.jsonl.
# Runs ../shared/bench/anchor.sh (the reference), then edgellm on OUTDIR/hf for each config, and
# prints one table; the last line is one JSON object with both sides and the ratios.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=${1:?usage: export_vs_anchor.sh OUTDIR [CONFIG ...]}; shift || true
configs=${*:-coreml_fp32 xnnpack_fp32}
py=${EDGELLM_PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"; out=$(cd "$out" && pwd)
[ "${SKIP_ANCHOR:-0}" = 1 ] || bash "$root/../shared/bench/anchor.sh" "$out" $configs
tag=edgellm${NO_VERIFY:+_noverify}
: > "$out/$tag.jsonl"
for c in $configs; do
  case $c in
    # the reference config sets ios 18 and cpu_and_ne and leaves precision at fp16, as here
    coreml_fp32) args="--backend coreml coreml.min_ios=18 coreml.compute_units=cpu_and_ne" ;;
    xnnpack_fp32) args="--backend xnnpack" ;;
    # export_llm's qmode 8da4w: group 128, HQQ scales, embeddings and head as the config leaves
    xnnpack_q8da4w) args="--backend xnnpack --quantize 8da4w" ;;
    xnnpack_q8da4w_emb4) args="--backend xnnpack --quantize 8da4w --embedding-quantize 4,32" ;;
    *) echo "unknown config $c" >&2; exit 2 ;;
  esac
  /usr/bin/time -v "$py" -m edgellm.cli export "$out/hf" -o "$out/${tag}_$c" --force \
      --max-seq-len 512 --max-context-len 512 --quiet ${NO_VERIFY:+--no-verify} $args \
      > "$out/${tag}_$c.log" 2>&1 \
      || [ $? = 1 ]  # 1: written, verification failed (random weights flatten 4-bit logits)
  "$py" "$here/summarize.py" "$c" "$out/${tag}_$c" "$out/${tag}_$c.log" >> "$out/$tag.jsonl"
done
"$py" "$here/summarize.py" --table "$out/anchor.jsonl" "$out/$tag.jsonl"
