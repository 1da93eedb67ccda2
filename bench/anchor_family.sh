# Sourced by bench/qwen3_vs_anchor.sh and bench/qwen3_5_vs_anchor.sh (which set here, py, venv):
# export_llm's side of a side-by-side run on a random checkpoint built from ExecuTorch's params.
#
# anchor_family OUTDIR PARAMS MODEL_CLASS EXAMPLE YAML PTE
#   OUTDIR/hf          bench/make_checkpoint.py PARAMS MODEL_CLASS --tied (seed 0), if missing
#   OUTDIR/anchor.pth  ExecuTorch's examples/models/EXAMPLE/convert_weights.py on it, if missing
#   OUTDIR/PTE         export_llm with EXAMPLE/config/YAML, max_seq_len and context 512; its log
#                      (with /usr/bin/time -v) in OUTDIR/anchor.log; SKIP_ANCHOR=1 keeps both
anchor_family() {
  local out=$1 params=$2 class=$3 example=$4 yaml=$5 pte=$6
  [ -f "$out/hf/config.json" ] || "$py" "$here/make_checkpoint.py" "$params" "$class" "$out/hf" \
      --tied
  [ -f "$out/anchor.pth" ] || "$venv/bin/python" -c "
from executorch.examples.models.$example.convert_weights import convert_weights
convert_weights('$out/hf', '$out/anchor.pth')"
  yaml=$("$venv/bin/python" -c "import os, executorch.examples.models.$example as m
print(os.path.join(os.path.dirname(m.__file__), 'config', '$yaml'))")
  [ "${SKIP_ANCHOR:-0}" = 1 ] || ( cd "$out" && /usr/bin/time -v "$venv/bin/python" \
      -m executorch.extension.llm.export.export_llm --config "$yaml" \
      +base.model_class="$class" +base.params="$params" +base.checkpoint="$out/anchor.pth" \
      ++export.max_seq_length=512 ++export.max_context_length=512 +export.output_name="$pte" \
      +debug.verbose=True ) > "$out/anchor.log" 2>&1 || true
}
