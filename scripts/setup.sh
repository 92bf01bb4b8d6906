#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned requirements (requirements.txt, and
# requirements-nodeps.txt without their dependencies) and minillm installed (editable).
# Re-running is cheap: it reinstalls only when one of those files or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.minillm-installed
want=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in ("requirements.txt", "requirements-nodeps.txt", "pyproject.toml"))).hexdigest())')
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  echo "$want" > "$stamp"
fi
