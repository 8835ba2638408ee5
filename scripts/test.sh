#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs the whole test suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check lightning_ft tests examples benchmarks
ruff format --check lightning_ft tests examples benchmarks
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
