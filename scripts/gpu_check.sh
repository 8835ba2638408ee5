#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU, in under 15 minutes on one: every gpu-marked test (pytest -m gpu),
# then benchmarks/gpu_staging.py, which prints a table (docs/performance.md, "GPU check"), then replica groups of a
# sharded model on CUDA with the groups joined over NCCL (torchft's ProcessGroupNCCL and ProcessGroupBabyNCCL) and
# gloo (tests/replica/test_replica_sharded_gpu.py; the NCCL cases need 2 GPUs). That last step is UNVERIFIED: the
# project's own machine has no GPU, and nothing in it has run on one yet.
# PYTHON=... picks the interpreter; by default the first of .venv-torch-2.14.1/bin/python (a CUDA build of torch:
# TORCH=2.14.1 bash scripts/setup_env.sh), .venv/bin/python (torch 2.13.0, a CPU build) and python3.
# Without a GPU it prints one line saying so and exits 2, running nothing. Otherwise it exits 1 if a test failed or
# the benchmark found a broken guarantee, else 0. `--list` prints the steps it runs, one a line, and exits 0 (no GPU
# needed: tests/test_gpu_check.py checks that each step's tests exist).
set -uo pipefail
cd "$(dirname "$0")/.."
REPLICA_NCCL=tests/replica/test_replica_sharded_gpu.py
if [ "${1:-}" = "--list" ]; then
  echo "pytest -m gpu tests --ignore=$REPLICA_NCCL"
  echo "benchmarks/gpu_staging.py"
  echo "pytest -m gpu $REPLICA_NCCL (unverified: NCCL across replica groups)"
  exit 0
fi
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv-torch-2.14.1/bin/python ]; then
  PY=.venv-torch-2.14.1/bin/python
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
if ! seen=$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
  echo "scripts/gpu_check.sh needs a CUDA GPU and torch, but $PY cannot import torch (TORCH=2.14.1 bash scripts/setup_env.sh builds a CUDA venv); nothing was run" >&2
  exit 2
fi
version=${seen% *}
devices=${seen#* }
if [ "$devices" = 0 ]; then
  echo "scripts/gpu_check.sh needs a CUDA GPU: torch $version ($PY) sees none; nothing was run" >&2
  exit 2
fi
echo "gpu_check: torch $version ($PY), $devices CUDA device(s)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
status=0
timeout 390 "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 300 -rs tests --ignore="$REPLICA_NCCL" || status=1
timeout 180 "$PY" benchmarks/gpu_staging.py || status=1
echo "gpu_check: replica groups of a sharded model over NCCL (unverified before this run)"
timeout 420 "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 400 -rs -s "$REPLICA_NCCL" || status=1
exit $status
