#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs the whole test suite (slow end-to-end tests included), then the
# Lightning-facing tests again on the lowest Lightning release the package declares (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check lightning_ft tests examples benchmarks
ruff format --check lightning_ft tests examples benchmarks
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
deactivate
if [ "$#" -eq 0 ]; then
  # Lowest declared Lightning beside the same torch: its own venv, so .venv keeps the current release.
  LOWEST_LIGHTNING=$(sed -n 's/.*"lightning>=\([0-9.]*\),.*/\1/p' pyproject.toml)
  VENV=.venv-lightning-$LOWEST_LIGHTNING bash scripts/setup_env.sh "lightning==$LOWEST_LIGHTNING.0"
  ".venv-lightning-$LOWEST_LIGHTNING/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/strategy tests/elastic tests/core tests/monitors tests/checkpoint/test_module_loader.py
fi
