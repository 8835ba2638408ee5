#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs the demo under real torchrun with 2 CPU ranks:
# checkpoints, one rank killed mid-run, a preemption, a hung rank; torchrun restarts the group, training resumes by
# itself after each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
OUT=${DEMO_DIR:-demo_run}
rm -rf "$OUT"
torchrun --standalone --nnodes=1 --nproc-per-node=2 --max-restarts=3 examples/demo.py --root "$OUT" "$@"
lightning-ft report "$OUT"
