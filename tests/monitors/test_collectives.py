"""The monitors' gathers run on a gloo group of their own, beside the training step's collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ft.monitors import _collectives
from tests.helpers import run_distributed


def test_without_a_process_group_a_gather_returns_the_own_row_and_no_group_is_made():
    _collectives.acquire_group()
    try:
        assert _collectives._group is None
        assert _collectives.start_gather_rows([1.0, 2.0], torch.device("cpu")).wait() == [[1.0, 2.0]]
    finally:
        _collectives.release_group()


def _gather_beside_a_training_collective(rank: int, world_size: int) -> None:
    _collectives.acquire_group()
    _collectives.acquire_group()  # a second monitor shares the group
    group = _collectives._group
    assert group is not None
    step = torch.ones(1)
    if rank == 1:
        # This rank's training step issued its collective first; the other rank gathers first. On one shared group the
        # two would be paired with each other; on the monitors' own group both complete.
        work = dist.all_reduce(step, async_op=True)
        rows = _collectives.start_gather_rows([float(rank), 2.0], torch.device("cpu")).wait()
        work.wait()
    else:
        rows = _collectives.start_gather_rows([float(rank), 2.0], torch.device("cpu")).wait()
        dist.all_reduce(step)
    assert rows == [[0.0, 2.0], [1.0, 2.0]]
    assert step.item() == world_size
    _collectives.release_group()
    assert _collectives._group is group  # still used by the other monitor
    _collectives.release_group()
    assert _collectives._group is None


def test_a_gather_does_not_queue_in_front_of_the_training_steps_collectives():
    run_distributed(_gather_beside_a_training_collective, 2, timeout_s=60)
