#!/usr/bin/env bash
# Build the book (executes every chapter and lab on this machine) and tell where the HTML is.
#   scripts/book.sh          build, print the path of index.html
#   scripts/book.sh --serve  build, then serve it on http://localhost:8000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A sentence its numbers no longer support fails the build (minillm/lab/claims.py).
export MINILLM_STRICT_CLAIMS=1
# Kernels draw with the inline backend whatever MPLBACKEND the shell has (Agg would draw nothing);
# scripts/test.sh builds the same way, so the execution cache either fills has every figure.
export MPLBACKEND=module://matplotlib_inline.backend_inline
# Every lab runs once, before the pages: a page shows the tables and figures its lab saved
# (_build/results/). A lab whose source is cached is not run again; the pages always are (--all),
# so they show the results of the labs as they now stand.
build() {
  .venv/bin/python scripts/cache_labs.py --run
  .venv/bin/jupyter-book build . -W --keep-going --all
}
# After a change to the package the labs import (or to its data), start from an empty execution
# cache and no saved results, so that no page shows outputs of the old code (scripts/fingerprint.sh).
fingerprint=$(bash scripts/fingerprint.sh)
if [ "$(cat _build/.code_fingerprint 2>/dev/null)" != "$fingerprint" ]; then
  rm -rf _build/.jupyter_cache _build/results
fi
mkdir -p _build
build
# A cache filled some other way (an older scripts/test.sh exported MPLBACKEND=Agg) would give a
# page without its figures: check every page, and if one lacks a figure, execute everything anew.
if ! .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_book_html.py \
     -k test_page_shows_its_figures >/dev/null 2>&1; then
  echo "Some pages lack figures their code draws (a stale execution cache?): rebuilding from scratch."
  rm -rf _build
  build
fi
echo "$fingerprint" > _build/.code_fingerprint
echo
echo "The book: file://$PWD/_build/html/index.html"
if [ "${1:-}" = "--serve" ]; then
  echo "Serving on http://localhost:8000 (Ctrl-C to stop)"
  .venv/bin/python -m http.server 8000 --directory _build/html
fi
