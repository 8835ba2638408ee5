"""A load that fails on one rank fails on every rank with the same error type, naming the rank that failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, CorruptCheckpointError, load_checkpoint
from lightning_ft.checkpoint.internal import SnapshotStorage
from tests.helpers import run_distributed


class UnreadableManifest(SnapshotStorage):
    def reader(self, path):
        raise RuntimeError("torchsnapshot manifest unreadable on this rank")


def _load_fails_on_rank_one(rank: int, world_size: int, root: str) -> None:
    path = Path(root) / "step=1"
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(path, {"w": torch.arange(8.0)}, metadata={"step": 1})
    finally:
        checkpointer.close()
    storage = UnreadableManifest() if rank == 1 else None
    with pytest.raises(CorruptCheckpointError) as raised:
        load_checkpoint(path, storage=storage)
    if rank == 0:
        assert "loading failed on rank 1: CorruptCheckpointError" in str(raised.value)
    else:
        assert "manifest unreadable on this rank" in str(raised.value)


def test_every_rank_raises_the_failing_ranks_error_type(tmp_path):
    run_distributed(_load_fails_on_rank_one, 2, str(tmp_path))
