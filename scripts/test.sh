#!/usr/bin/env bash
# All tests: unit/property/parity tests, every lab notebook under nbmake, and the book build
# with warnings as errors. Runs on a CPU; no network beyond the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MINILLM_DEVICE=${MINILLM_DEVICE:-cpu} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONHASHSEED=0 MPLBACKEND=Agg
echo "== unit, property and parity tests"
.venv/bin/python -m pytest tests
echo "== labs (nbmake)"
.venv/bin/python -m pytest --nbmake --nbmake-timeout=900 notebooks
echo "== book (jupyter-book build -W)"
rm -rf _build
.venv/bin/jupyter-book build . -W --keep-going
echo "book built: _build/html/index.html"
