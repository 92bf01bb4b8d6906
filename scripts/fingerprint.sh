#!/usr/bin/env bash
# One hash of the code and data the book's pages import (minillm/, data/, requirements.txt). The
# execution cache keys a page by its own code cells only; scripts/book.sh compares this hash with
# the one the last build left in _build/.code_fingerprint and starts from an empty cache when they differ.
set -euo pipefail
cd "$(dirname "$0")/.."
find minillm data requirements.txt -type f ! -path '*/__pycache__/*' -print0 | sort -z |
  xargs -0 sha1sum | sha1sum | cut -d' ' -f1
