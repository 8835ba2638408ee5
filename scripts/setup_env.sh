#!/usr/bin/env bash
# Creates a virtual environment (default .venv; VENV=... for another) and installs lightning-ft with its dev extras.
# torch 2.13.0 is installed first, on its own: an unpinned torch would pull a multi-GB CUDA build. Arguments are
# extra requirements installed (without their dependencies) before the package, e.g. "lightning==2.5.0".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0
if [ "$#" -gt 0 ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$@"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
