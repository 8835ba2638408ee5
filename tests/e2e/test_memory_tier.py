"""The memory tier under real torchrun: a SIGKILLed worker's next attempt restores every rank from its node's memory
copy, and ends bitwise where an uninterrupted run (without the tier) ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ft.events import read_events
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("memory_tier_script.py")


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        str(SCRIPT),
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(**env), capture_output=True, text=True, timeout=600)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    )


def weights(out: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(f, weights_only=True) for f in sorted(out.glob("weights_rank*.pt"))]


def assert_bitwise_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b) > 0
    for wa, wb in zip(a, b, strict=True):
        assert wa.keys() == wb.keys()
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(torchrun("--root", str(root), "--out", str(root / "out"), env={}))
    return weights(root / "out")


def test_a_sigkilled_worker_resumes_from_the_local_memory_tier_bitwise(tmp_path, uninterrupted):
    shm = tmp_path / "shm"
    proc = torchrun(
        "--root", str(tmp_path), "--out", str(tmp_path / "out"), "--memory-every", "2",
        "--faults", "kill_at:rank=1,step=7,attempt=0",
        max_restarts=1,
        env={"LIGHTNING_FT_MEMORY_DIR": str(shm)},
    )  # fmt: skip
    assert_ok(proc)
    assert "[fault] SIGKILL" in proc.stdout
    assert_bitwise_equal(weights(tmp_path / "out"), uninterrupted)
    found = read_events(tmp_path)
    (resumed,) = [e for e in found if e["event"] == "resumed"]
    assert resumed["tier"] == "local" and resumed["restored_from"] == {"local": 2, "peer": 0, "durable": 0}
    before_kill = [
        e["step"] for e in found if e["event"] == "checkpoint_committed" and e["tier"] == "durable" and e["attempt"] == 0
    ]
    assert resumed["step"] > max(before_kill, default=0)  # newer than anything the durable tier had
    assert not list(shm.glob("lightning-ft/*"))  # the finished run removed its copies
