#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned requirements and minillm installed (editable).
# Re-running is cheap: it reinstalls only when requirements.txt or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.minillm-installed
want=$(.venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(open("requirements.txt", "rb").read() + open("pyproject.toml", "rb").read()).hexdigest())')
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  echo "$want" > "$stamp"
fi
