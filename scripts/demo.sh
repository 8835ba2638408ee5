#!/usr/bin/env bash
# Fresh machine: creates the environment, then runs the demo under real torchrun with 2 CPU ranks:
# checkpoints, one rank killed mid-run, a preemption, a hung rank; torchrun restarts the group, training resumes by
# itself after each.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'demo: %s\n' "$*"; }
if [ -x .venv/bin/lightning-ft ]; then
  say "checking .venv (torch 2.13.0 CPU, lightning-ft and its dev extra are installed)"
else
  say "first run: creating .venv and installing torch 2.13.0 (CPU build), Lightning, torchsnapshot and"
  say "lightning-ft with its dev extra; this takes several minutes"
fi
start=$SECONDS
(while sleep 30; do say "still installing ($((SECONDS - start)) s so far)"; done) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true' EXIT
bash scripts/setup_env.sh
kill "$ticker" 2>/dev/null || true
say "environment ready ($((SECONDS - start)) s)"
. .venv/bin/activate
export OMP_NUM_THREADS=1
OUT=${DEMO_DIR:-demo_run}
rm -rf "$OUT"
say "training on 2 CPU ranks under torchrun in $OUT/ (one rank killed, a preemption, a hang; each run resumes)"
torchrun --standalone --nnodes=1 --nproc-per-node=2 --max-restarts=3 examples/demo.py --root "$OUT" "$@"
say "the run's goodput and incidents, from its event log $OUT/lightning-ft/events/:"
lightning-ft report "$OUT"
