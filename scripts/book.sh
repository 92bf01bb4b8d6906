#!/usr/bin/env bash
# Build the book (executes every chapter and lab on this machine) and tell where the HTML is.
#   scripts/book.sh          build, print the path of index.html
#   scripts/book.sh --serve  build, then serve it on http://localhost:8000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/jupyter-book build . -W --keep-going
echo
echo "The book: file://$PWD/_build/html/index.html"
if [ "${1:-}" = "--serve" ]; then
  echo "Serving on http://localhost:8000 (Ctrl-C to stop)"
  .venv/bin/python -m http.server 8000 --directory _build/html
fi
