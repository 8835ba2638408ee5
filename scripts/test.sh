#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs the whole test suite (slow end-to-end tests included), then the
# Lightning-facing tests again on the lowest Lightning release the package declares (pyproject.toml).
# TORCH=<release> bash scripts/test.sh [pytest arguments]: only the pass on that torch release (its own venv,
# .venv-torch-<release>, built by scripts/setup_env.sh): the torch-facing tests, or what the arguments select. The
# torch 2.14.1 pass (TORCH=2.14.1) is not part of the no-argument run: with its 5.7 GB install it would take the whole
# command past the time CI allows on a loaded machine (docs/performance.md, "Torch releases").
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
# The tests that reach into torch (checkpoint staging and loading, DTensor geometry, DCP, the strategy's process
# groups and resume, the private names in lightning_ft/_compat.py); the end-to-end runs are left to the main pass.
TORCH_FACING=(-m "not slow" tests/checkpoint tests/strategy tests/core)

torch_pass() {
  local release=$1
  shift
  # A release other than CI's is tested as pip gives it to a GPU user (torch 2.14.1 from PyPI: the CUDA build, which
  # runs on CPU too), unless TORCH_INDEX says otherwise (TORCH_INDEX=cpu: its CPU build; scripts/setup_env.sh).
  local index=${TORCH_INDEX:-}
  [ "$release" != "2.13.0" ] && index=${index:-default}
  TORCH=$release TORCH_INDEX=$index bash scripts/setup_env.sh
  local venv=.venv-torch-$release
  [ "$release" = "2.13.0" ] && venv=.venv
  if [ "$#" -eq 0 ]; then
    set -- "${TORCH_FACING[@]}"
  fi
  "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=10 "$@"
}

if [ -n "${TORCH:-}" ]; then
  torch_pass "$TORCH" "$@"
  exit
fi
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check lightning_ft tests examples benchmarks
ruff format --check lightning_ft tests examples benchmarks
# The documentation site, with warnings as errors: a broken link or anchor, or a docstring the API page cannot render,
# fails here (CONTRIBUTING.md, "The documentation").
SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$SITE"
rm -rf "$SITE"
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
deactivate
if [ "$#" -eq 0 ]; then
  # Lowest declared Lightning beside the same torch: its own venv, so .venv keeps the current release.
  LOWEST_LIGHTNING=$(sed -n 's/.*"lightning>=\([0-9.]*\),.*/\1/p' pyproject.toml)
  VENV=.venv-lightning-$LOWEST_LIGHTNING bash scripts/setup_env.sh "lightning==$LOWEST_LIGHTNING.0"
  ".venv-lightning-$LOWEST_LIGHTNING/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/strategy tests/elastic tests/core tests/monitors tests/checkpoint/test_module_loader.py
fi
