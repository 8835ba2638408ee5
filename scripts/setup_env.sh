#!/usr/bin/env bash
# Creates a virtual environment and installs lightning-ft with its dev extras.
# torch is installed first, on its own: an unpinned torch would pull a multi-GB CUDA build. TORCH=... picks the
# release (default 2.13.0, the CPU build CI tests); any other release gets its own venv, .venv-torch-<release>.
# Where torch comes from (scripts/torch_source.py): on a machine without an NVIDIA GPU (no nvidia-smi), the CPU build,
# from PyTorch's CPU index (https://download.pytorch.org/whl/cpu) unless pip as configured already gives a CPU build or
# a wheel on this machine; with a GPU, pip's choice (the CUDA build). TORCH_INDEX=default keeps pip's choice anyway
# (TORCH=2.14.1 from PyPI: a CUDA build of about 1 GB plus its CUDA libraries, which also runs on CPU), TORCH_INDEX=cpu
# forces the CPU index, TORCH_INDEX=<url> names another. A venv that already has the release installs nothing.
# VENV=... names another venv. Arguments are extra requirements installed (without their dependencies) before the
# package, e.g. "lightning==2.5.0". The script fails if installing the package replaced the torch installed first.
# SETUP_DRY_RUN=1 prints the torch install command and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
if [ "$TORCH" = "2.13.0" ]; then
  VENV=${VENV:-.venv}
else
  VENV=${VENV:-.venv-torch-$TORCH}
fi
PIP=(-m pip install --quiet --disable-pip-version-check)
if [ "${SETUP_DRY_RUN:-0}" = "1" ]; then
  TORCH_ARGS=$("$PY" scripts/torch_source.py "$TORCH")
  echo "$VENV/bin/python ${PIP[*]} torch==$TORCH${TORCH_ARGS:+ $TORCH_ARGS}"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
HAVE=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$HAVE" != "$TORCH" ]; then
  TORCH_ARGS=$("$VENV/bin/python" scripts/torch_source.py "$TORCH")
  # shellcheck disable=SC2086 # the arguments are words without spaces (an option and a URL)
  "$VENV/bin/python" "${PIP[@]}" "torch==$TORCH" $TORCH_ARGS
fi
if [ "$#" -gt 0 ]; then
  "$VENV/bin/python" "${PIP[@]}" --no-deps "$@"
fi
"$VENV/bin/python" "${PIP[@]}" -e ".[dev]"
INSTALLED=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$INSTALLED" != "$TORCH" ]; then
  echo "scripts/setup_env.sh: $VENV has torch $INSTALLED after installing lightning-ft, expected $TORCH" >&2
  exit 1
fi
