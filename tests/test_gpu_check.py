"""scripts/gpu_check.sh and benchmarks/gpu_staging.py on a machine without a GPU: one clear line, a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_gpu_check_without_a_gpu_says_it_needs_one_and_runs_nothing():
    result = _run("bash", "scripts/gpu_check.sh")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"scripts/gpu_check.sh needs a CUDA GPU: torch {torch.__version__} ({sys.executable}) sees none;"
        " nothing was run"
    ]


def test_the_gpu_check_with_an_interpreter_without_torch_says_so():
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env={**os.environ, "PYTHON": "/bin/false"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "needs a CUDA GPU and torch, but /bin/false cannot import torch" in line


def test_the_gpu_benchmark_without_a_gpu_says_it_needs_one():
    result = _run(sys.executable, "benchmarks/gpu_staging.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"benchmarks/gpu_staging.py needs a CUDA GPU; torch {torch.__version__} sees none"
    )


def test_the_gpu_check_lists_its_steps_and_the_nccl_replica_step_collects_and_skips_cleanly_without_a_gpu():
    """How the NCCL step (replica groups of a sharded model joined over torchft's ProcessGroupNCCL and
    ProcessGroupBabyNCCL) is checked on a machine without a GPU: the script names it, marked unverified, and its three
    cases exist and skip with a reason here; what they assert runs only on a GPU machine."""
    listed = _run("bash", "scripts/gpu_check.sh", "--list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [
        "pytest -m gpu tests --ignore=tests/replica/test_replica_sharded_gpu.py",
        "benchmarks/gpu_staging.py",
        "pytest -m gpu tests/replica/test_replica_sharded_gpu.py (unverified: NCCL across replica groups)",
    ]
    target = "tests/replica/test_replica_sharded_gpu.py"
    pytest_here = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    collected = subprocess.run(
        [*pytest_here, "--collect-only", target], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    ids = [line.split("[", 1)[1].rstrip("]") for line in collected.stdout.splitlines() if line.startswith(target)]
    assert ids == ["gloo", "nccl", "baby_nccl"], collected.stdout[-2000:]
    run = subprocess.run([*pytest_here, "-rs", target], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "3 skipped" in run.stdout and "needs CUDA" in run.stdout, run.stdout[-2000:]
