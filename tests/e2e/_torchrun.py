"""Launch tests/e2e/train_script.py under real torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import REPO_ROOT, subprocess_env

SCRIPT = Path(__file__).with_name("train_script.py")


def torchrun(
    *args: str,
    nproc: int = 2,
    max_restarts: int = 0,
    timeout: float = 240,
    script: Path = SCRIPT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        str(script),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )


def load_run(out: Path) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("weights_rank*.pt")):
        for name, tensor in torch.load(file, weights_only=True).items():
            assert name not in weights or torch.equal(weights[name], tensor), f"ranks disagree on {name}"
            weights[name] = tensor
    losses = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    return weights, losses


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    )


def rank_weights(out: Path) -> list[dict[str, torch.Tensor]]:
    """Every rank's saved weights (``weights_rank<N>.pt`` under ``out``), in rank order."""
    return [torch.load(f, weights_only=True) for f in sorted(out.glob("weights_rank*.pt"))]


def assert_bitwise_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    """Rank by rank, the same tensor names with bitwise equal values (and at least one rank)."""
    assert len(a) == len(b) > 0
    for wa, wb in zip(a, b, strict=True):
        assert wa.keys() == wb.keys()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name


def torchrun_popen(
    script: Path,
    *args: str,
    log: Path,
    nproc: int = 1,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``script`` under real torchrun (standalone, one node) in the background, stdout and stderr to ``log``.

    The caller waits for it or kills it (``Popen.kill`` ends the torchrun agent only: kill its workers by pid)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", str(script), *args]
    out = open(log, "w")  # noqa: SIM115 - the child holds it; closed when this process's handle is collected
    try:
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=subprocess_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT
        )
    finally:
        out.close()
