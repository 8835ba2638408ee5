"""Several torchrun agents on this machine, each a simulated node of one elastic job (docs/elastic.md's recipe).

The rendezvous store is a TCPStore hosted by the test process, so it outlives every agent; agents join it with
``is_host=false``; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each rendezvous round a fresh process-group store
hosted by that round's rank 0. Killing a node kills its agent and its workers (torchrun starts workers in sessions of
their own, so killing the agent alone would orphan them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tests.helpers import REPO_ROOT, free_port, subprocess_env

RDZV_CONF = "is_host=false,join_timeout=300,last_call_timeout=10,close_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
"""Rendezvous timeouts that matter on a membership change: a dead node leaves the rendezvous after
``keep_alive_interval x keep_alive_max_attempt`` seconds; a round closes ``last_call_timeout`` after ``min`` nodes
joined, so it must cover the time the slowest node takes to stop its workers and rejoin (with 1 s, rounds closed
without a lagging node, which then joined as a "new node" and restarted everyone again, several times over)."""


class Node:
    """One torchrun agent (``--nproc-per-node=1``), its output in ``log``."""

    def __init__(self, name: str, proc: subprocess.Popen, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log

    def workers(self) -> list[int]:
        pids: list[int] = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                pids += [int(p) for p in children.read_text().split()]
            except OSError:
                pass
        return pids

    def kill(self) -> None:
        """SIGKILL the node: its workers and its agent, as a machine that dies."""
        workers = self.workers()
        for pid in [self.proc.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class ElasticJob:
    """An elastic torchrun job of 1 to ``max_nodes`` single-process nodes running ``script`` with ``args``."""

    def __init__(self, workdir: Path, script: Path, args: list[str], *, max_nodes: int = 3, min_nodes: int = 1) -> None:
        self.workdir, self.script, self.args, self.max_nodes = workdir, script, args, max_nodes
        self.min_nodes = min_nodes
        self.port = free_port()
        self.store = dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
        )
        self.nodes: list[Node] = []
        self.env = subprocess_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")

    def start_node(self, **env: str) -> Node:
        """Start one more agent; ``env`` is added to its environment. Its name ``node<k>`` is also its
        ``LIGHTNING_FT_NODE_NAME`` (the name of its health record)."""
        name = f"node{len(self.nodes)}"
        log = self.workdir / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=elastic-e2e",
            f"--rdzv-conf={RDZV_CONF}",
            "--max-restarts=20",
            "--monitor-interval=0.5",
            str(self.script),
            *self.args,
        ]
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env={**self.env, "LIGHTNING_FT_NODE_NAME": name, **env},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        node = Node(name, proc, log)
        self.nodes.append(node)
        return node

    def wait_for(
        self, what: str, condition: Callable[[], bool], timeout: float, *, may_fail: tuple[str, ...] = ()
    ) -> None:
        """Poll ``condition`` until true; fail at ``timeout`` or when a node not named in ``may_fail`` failed."""
        deadline = time.monotonic() + timeout
        while not condition():
            failed = [
                n
                for n in self.nodes
                if n.proc.poll() not in (None, 0) and n.proc.returncode != -9 and n.name not in may_fail
            ]
            if failed or time.monotonic() > deadline:
                raise AssertionError(
                    f"waiting for {what}: " + ("nodes failed" if failed else "timed out") + self.logs()
                )
            time.sleep(0.5)

    def logs(self) -> str:
        return "".join(f"\n--- {n.name} (exit {n.proc.poll()}) ---\n{n.output()[-5000:]}" for n in self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.kill()
