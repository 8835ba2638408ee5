#!/usr/bin/env bash
# Creates a virtual environment and installs lightning-ft with its dev extras.
# torch is installed first, on its own: an unpinned torch would pull a multi-GB CUDA build. TORCH=... picks the
# release (default 2.13.0, the CPU build CI tests); any other release gets its own venv, .venv-torch-<release>
# (TORCH=2.14.1: a CUDA build of about 1 GB plus its CUDA libraries, which also runs on CPU). VENV=... names another
# venv. Arguments are extra requirements installed (without their dependencies) before the package, e.g.
# "lightning==2.5.0". The script fails if installing the package replaced the torch installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
if [ "$TORCH" = "2.13.0" ]; then
  VENV=${VENV:-.venv}
else
  VENV=${VENV:-.venv-torch-$TORCH}
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH"
if [ "$#" -gt 0 ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$@"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
INSTALLED=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$INSTALLED" != "$TORCH" ]; then
  echo "scripts/setup_env.sh: $VENV has torch $INSTALLED after installing lightning-ft, expected $TORCH" >&2
  exit 1
fi
