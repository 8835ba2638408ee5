"""Helpers shared by the test tiers: free ports, multi-process gloo runs, small models."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_a_new_process() -> None:
    """Stand a relaunch in this process: forget which checkpoint folders this process saved into or trained over, as a
    new process does (a later fit in the same process does not auto-resume them, as under DDPStrategy). The model and
    Trainer of the relaunch must be new objects too."""
    from lightning_ft.strategy.run_identity import forget_folders_used

    forget_folders_used()


def free_port() -> int:
    """A TCP port the OS says is free right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, error_queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        fn(rank, world_size, *args)
    except BaseException:
        error_queue.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """Fresh worker processes forked from a server that imported torch and Lightning once, instead of a new interpreter
    importing them for every rank of every test (the bulk of a distributed test's time on 2 cores). The server starts
    clean: no process group, no thread of the test process is inherited."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "lightning_ft", "tests.helpers"])
    return ctx


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a gloo process group.

    ``fn`` must be importable (a module-level function). A failure on any rank fails the caller with that rank's
    traceback.
    """
    ctx = _context()
    error_queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, error_queue), daemon=False)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    errors = []
    while not error_queue.empty():
        errors.append(error_queue.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise AssertionError(f"ranks {[procs.index(p) for p in alive]} did not finish within {timeout_s}s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python process that imports this checkout, with one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


PYTHON = sys.executable
