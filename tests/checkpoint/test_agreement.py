"""One exchange ends every collective step: if any rank failed, every rank raises, naming the failing rank."""

from __future__ import annotations

import errno

import pytest

from lightning_ft.checkpoint import CheckpointError, CheckpointWriteError
from lightning_ft.checkpoint.agreement import agree
from tests.helpers import run_distributed


def test_without_torch_distributed_the_own_error_is_raised_or_the_payload_returned():
    assert agree(None, {"records": 3}, group=None, what="checkpoint save") == [{"records": 3}]
    error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as raised:
        agree(error, group=None, what="checkpoint save")
    assert raised.value is error


def _agree_on_three_ranks(rank: int, world_size: int) -> None:
    assert agree(None, ("payload", rank), group=None, what="loading") == [("payload", r) for r in range(3)]

    # Rank 1 fails: it raises its own error; the others raise the caller's error type naming rank 1.
    own = OSError(errno.EIO, "Input/output error") if rank == 1 else None
    expected = OSError if rank == 1 else CheckpointWriteError
    with pytest.raises(expected) as raised:
        agree(own, group=None, what="checkpoint save", error_type=CheckpointWriteError)
    if rank == 1:
        assert raised.value is own
    else:
        assert str(raised.value) == "checkpoint save failed on rank 1: OSError: [Errno 5] Input/output error"

    # Ranks 1 and 2 fail differently: each raises its own, and rank 0 names the lowest failing rank.
    own = {1: ValueError("template of rank one"), 2: KeyError("two")}.get(rank)
    with pytest.raises(CheckpointError if rank == 0 else type(own)) as raised:
        agree(own, group=None, what="loading", error_type=CheckpointError)
    if rank == 0:
        assert type(raised.value) is CheckpointError
        assert str(raised.value) == "loading failed on rank 1: ValueError: template of rank one"
    else:
        assert raised.value is own


def test_every_rank_raises_when_one_fails_and_the_failing_ranks_raise_their_own_errors():
    run_distributed(_agree_on_three_ranks, 3)
