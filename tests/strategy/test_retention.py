"""Retention never deletes the checkpoint being written or the newest committed one (Lightning #14035)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import AsyncCheckpointer, CommitInfo, is_committed


def _committed(path, step):
    ckpt = AsyncCheckpointer()
    ckpt.save(path, {"w": torch.full((4,), float(step))}, metadata={"step": step})
    ckpt.close()
    assert is_committed(path)


def test_removal_of_the_newest_committed_checkpoint_waits_for_the_next_commit(tmp_path):
    older, newest, in_flight = tmp_path / "step=2", tmp_path / "step=4", tmp_path / "step=6"
    _committed(older, 2)
    _committed(newest, 4)
    strategy = ElasticFT3D()
    strategy._checkpointer = SimpleNamespace(in_flight=in_flight)

    # ModelCheckpoint(save_top_k=1) asks to drop both older ones while step 6 is still being written.
    strategy.remove_checkpoint(older)
    strategy.remove_checkpoint(newest)
    assert not older.exists()
    assert is_committed(newest), "the only committed checkpoint was deleted while its successor was in flight"

    _committed(in_flight, 6)
    strategy._checkpointer = SimpleNamespace(in_flight=None)
    strategy._on_commit(CommitInfo(path=in_flight, step=6, stall_s=0.0, total_s=0.0, size_bytes=1))
    assert not newest.exists()
    assert is_committed(in_flight)


def test_removing_a_checkpoint_that_is_still_being_written_waits_for_its_commit(tmp_path):
    in_flight = tmp_path / "step=2"
    strategy = ElasticFT3D()
    strategy._checkpointer = SimpleNamespace(in_flight=in_flight)
    in_flight.mkdir()
    strategy.remove_checkpoint(in_flight)
    assert in_flight.exists()
