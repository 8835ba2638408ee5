"""Each torchrun worker group gets a process group of its own on the shared agent store, whatever the restart counts.

The agent store is a TCPStore that outlives the worker groups (here: hosted by the test process). A first group
initialises its process group and dies without cleaning up, leaving its keys behind (pytorch #135712). The next group
has per-node restart counts that disagree, as after a node joined (count 0) while the others restarted (count 1):
it must still form one working group, on keys of its own.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ft.strategy import process_group
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(300)


def _member(rank: int, world: int, port: int, restart: int, errors, result) -> None:
    os.environ.update(
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_RUN_ID="test-run",
    )
    torch.set_num_threads(1)
    try:
        env = SimpleNamespace(main_address="127.0.0.1", main_port=port)
        ok = process_group.init_for_this_restart(
            env, backend="gloo", global_rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        result.put((rank, ok, float(value)))
        sys.stdout.flush()
        os._exit(0)  # die without destroying the group: its keys stay in the store
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        os._exit(1)


def _run_group(port: int, restarts: list[int]) -> list[tuple[int, bool, float]]:
    ctx = mp.get_context("fork")  # no re-import per process: the members only need torch
    errors, result = ctx.SimpleQueue(), ctx.SimpleQueue()
    world = len(restarts)
    procs = [ctx.Process(target=_member, args=(r, world, port, restarts[r], errors, result)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    out = []
    while not result.empty():
        out.append(result.get())
    return sorted(out)


def test_worker_groups_with_disagreeing_restart_counts_form_one_group_on_keys_of_their_own():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    first = _run_group(port, [0, 0])
    assert first == [(0, True, 3.0), (1, True, 3.0)]
    # A third node joined (restart count 0) while the first two restarted (count 1).
    second = _run_group(port, [1, 1, 0])
    assert second == [(0, True, 6.0), (1, True, 6.0), (2, True, 6.0)]
    assert store.add("lightning_ft/test-run/generation", 0) == 2
