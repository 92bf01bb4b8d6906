#!/usr/bin/env bash
# All tests: unit/property/parity tests, every lab notebook under nbmake, and the book build
# with warnings as errors. Runs on a CPU; no network beyond the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MINILLM_DEVICE=${MINILLM_DEVICE:-cpu} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONHASHSEED=0
# In the book build and under nbmake a sentence its numbers no longer support fails (a reader's own
# run of a lab prints a note instead): minillm/lab/claims.py.
export MINILLM_STRICT_CLAIMS=1
# Kernels (nbmake's and the book's) draw with the inline backend, as in JupyterLab and as
# scripts/book.sh does: a kernel started with MPLBACKEND=Agg draws no figure, and the execution
# cache it fills would give scripts/book.sh a book without figures.
export MPLBACKEND=module://matplotlib_inline.backend_inline
echo "== unit, property and parity tests"
MPLBACKEND=Agg .venv/bin/python -m pytest tests --ignore=tests/test_book_html.py
echo "== labs (nbmake)"
# nbmake runs copies of the labs (--overwrite keeps their outputs there) and the book build takes
# those outputs from its execution cache instead of running every lab a second time; the build
# also reuses the machine profile the labs measured (_build/machine_profile-*.json), so the pages
# and the labs quote one measurement.
rm -rf _build .labs && mkdir .labs && cp notebooks/*.ipynb .labs/
.venv/bin/python -m pytest --nbmake --nbmake-timeout=900 --overwrite -p no:cacheprovider .labs
.venv/bin/python scripts/cache_labs.py .labs
echo "== book (jupyter-book build -W)"
.venv/bin/jupyter-book build . -W --keep-going
bash scripts/fingerprint.sh > _build/.code_fingerprint  # scripts/book.sh may reuse this build's cache
echo "book built: _build/html/index.html"
echo "== the built book: figures, offline (headless Chromium), quotation marks"
.venv/bin/python -m pytest tests/test_book_html.py -rs
