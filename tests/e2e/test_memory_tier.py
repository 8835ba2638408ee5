"""The memory tier under real torchrun: a SIGKILLed worker's next attempt restores every rank from its node's memory
copy; with two agents as simulated nodes, a lost node's rank restores from the peer copy its partner keeps, and two
nodes lost at once fall back to the durable tier. Each ends bitwise where an uninterrupted run (without the tier)
ends."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ft.events import read_events
from tests.e2e._elastic_launch import RDZV_CONF, Node
from tests.e2e._torchrun import assert_bitwise_equal, assert_ok, rank_weights
from tests.e2e._torchrun import torchrun as _torchrun
from tests.helpers import REPO_ROOT, free_port, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("memory_tier_script.py")


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _torchrun(*args, nproc=nproc, max_restarts=max_restarts, timeout=600, script=SCRIPT, env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(torchrun("--root", str(root), "--out", str(root / "out"), env={}))
    return rank_weights(root / "out")


def test_a_sigkilled_worker_resumes_from_the_local_memory_tier_bitwise(tmp_path, uninterrupted):
    shm = tmp_path / "shm"
    proc = torchrun(
        "--root", str(tmp_path), "--out", str(tmp_path / "out"), "--memory-every", "2",
        "--faults", "kill_at:rank=1,step=7,attempt=0", "--settle-at", "7",
        max_restarts=1,
        env={"LIGHTNING_FT_MEMORY_DIR": str(shm)},
    )  # fmt: skip
    assert_ok(proc)
    assert "[fault] SIGKILL" in proc.stdout
    assert_bitwise_equal(rank_weights(tmp_path / "out"), uninterrupted)
    # A callback's state is the one its hooks of the restored step left, as in a durable checkpoint of that step:
    # every committed batch counted once (the memory tier saves after the other callbacks' on_train_batch_end).
    assert [(tmp_path / "out" / f"batches_rank{r}.txt").read_text() for r in range(2)] == ["14", "14"]
    found = read_events(tmp_path)
    (resumed,) = [e for e in found if e["event"] == "resumed"]
    assert resumed["tier"] == "local" and resumed["restored_from"] == {"local": 2, "peer": 0, "durable": 0}
    before_kill = [
        e["step"]
        for e in found
        if e["event"] == "checkpoint_committed" and e["tier"] == "durable" and e["attempt"] == 0
    ]
    assert resumed["step"] > max(before_kill, default=0)  # newer than anything the durable tier had
    assert not list(shm.glob("lightning-ft/*"))  # the finished run removed its copies


class TwoNodeJob:
    """A torchrun job of 2 single-process agents (simulated nodes), each with a memory folder of its own; a node that
    is killed is replaced by a new agent with an empty folder (its RAM is gone)."""

    def __init__(self, workdir: Path, args: list[str]) -> None:
        self.workdir, self.args = workdir, args
        self.port = free_port()
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
        )
        self.nodes: list[Node] = []
        self.rdzv_id = "memory-tier-e2e"

    def memory_dir(self, node: Node) -> Path:
        return self.workdir / f"shm-{node.name}"

    def start_node(self) -> Node:
        name = f"node{len(self.nodes)}"
        log = self.workdir / f"{name}.log"
        env = subprocess_env(
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LIGHTNING_FT_MEMORY_DIR=str(self.workdir / f"shm-{name}")
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={RDZV_CONF}", "--max-restarts=5", "--monitor-interval=0.5", str(SCRIPT), *self.args,
        ]  # fmt: skip
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        node = Node(name, proc, log)
        self.nodes.append(node)
        return node

    def lose(self, node: Node) -> None:
        """The machine dies: its agent and workers are SIGKILLed and its memory is gone."""
        node.kill()
        shutil.rmtree(self.memory_dir(node), ignore_errors=True)

    def wait_for(self, what: str, condition, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [n for n in self.nodes if n.proc.poll() not in (None, 0, -9)]
            if failed or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: {'nodes failed' if failed else 'timed out'}{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "".join(f"\n--- {n.name} (exit {n.proc.poll()}) ---\n{n.output()[-5000:]}" for n in self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.kill()


def _memory_committed(root: Path, step: int) -> bool:
    return any(
        e["event"] == "checkpoint_committed" and e.get("tier") == "memory" and e["step"] >= step
        for e in read_events(root)
    )


def _lost_nodes_run(tmp_path: Path, *, lose: int) -> list[dict]:
    root, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    args = ["--root", str(root), "--out", str(root / "out"), "--memory-every", "2", "--hold-file", str(hold)]
    job = TwoNodeJob(tmp_path, [*args, "--hold-step", "7"])
    try:
        job.start_node()
        job.start_node()
        job.wait_for("the memory save of step 6 with its peer copies", lambda: _memory_committed(root, 6))
        time.sleep(2)  # both workers are holding at step 7 by now (the hold follows the save)
        for node in job.nodes[:lose]:
            job.lose(node)
        hold.unlink()  # a survivor's next collective finds its peer gone
        if lose == 2:
            job.rdzv_id += "-requeued"  # nothing survives: the job is launched again, as a requeue does
        for _ in range(lose):
            job.start_node()  # the replacement joins with an empty memory folder
        live = job.nodes[-2:]
        job.wait_for("the end of training", lambda: all(n.proc.poll() is not None for n in live))
        assert all(n.proc.returncode == 0 for n in live), job.logs()
    finally:
        job.close()
    return read_events(root)


# Extended tier: about 3.5 minutes each on the shared machine (two agents, a rendezvous after the loss).
@pytest.mark.extended
@pytest.mark.timeout(1200)
def test_a_lost_node_s_ranks_restore_from_their_partner_s_peer_copies_bitwise(tmp_path, uninterrupted):
    found = _lost_nodes_run(tmp_path, lose=1)
    (resumed,) = [e for e in found if e["event"] == "resumed"]
    assert resumed["tier"] == "peer" and resumed["step"] == 6
    assert resumed["restored_from"] == {"local": 1, "peer": 1, "durable": 0}
    assert_bitwise_equal(rank_weights(tmp_path / "run" / "out"), uninterrupted)


@pytest.mark.extended
@pytest.mark.timeout(1200)
def test_two_nodes_lost_at_once_fall_back_to_the_durable_tier_bitwise(tmp_path, uninterrupted):
    found = _lost_nodes_run(tmp_path, lose=2)
    (resumed,) = [e for e in found if e["event"] == "resumed"]
    assert resumed["tier"] == "durable" and resumed["step"] == 4
    assert_bitwise_equal(rank_weights(tmp_path / "run" / "out"), uninterrupted)
