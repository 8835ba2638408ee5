#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs an elastic job on two torchrun agents (simulated nodes): one node
# is killed (the job shrinks to 1 and resumes), a new one joins (it grows back to 2); training finishes and the
# resizes are printed with the time each cost.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
OUT=${DEMO_DIR:-elastic_run}
rm -rf "$OUT"
python examples/elastic_demo.py --root "$OUT" "$@"
lightning-ft report "$OUT"
