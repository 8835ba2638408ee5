#!/usr/bin/env bash
# Creates .venv (if missing) and installs lightning-ft with its dev extras.
# torch 2.13.0 is installed first, on its own: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
