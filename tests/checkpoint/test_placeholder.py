"""The name of a save exists from the save call on (Lightning's version counter looks), yet a half-written save is
never taken for a checkpoint: a placeholder of ours holds a new file's name until the commit replaces it, and a kill
leaves nothing that is not removed at the next start."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, cleanup_uncommitted, latest_committed, list_committed
from lightning_ft.checkpoint.in_progress import has_record, is_ours, is_placeholder, write_placeholder
from lightning_ft.checkpoint.internal import is_committed
from lightning_ft.checkpoint.single_file import FileStorage, is_checkpoint_file
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from lightning_ft.checkpoint.swap import recover_interrupted_swaps
from tests.checkpoint.support import in_forked_child, kill_this_process


def _state(step: int) -> dict:
    return {"state_dict": {"w": torch.full((64,), float(step))}, "global_step": step}


class HeldStorage:
    """A storage seam whose write waits until the test releases it: a save stays in flight as long as needed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.writes_files = getattr(inner, "writes_files", False)
        self.release = threading.Event()

    def write(self, *args, **kwargs):
        assert self.release.wait(60)
        return self.inner.write(*args, **kwargs)

    def reader(self, path):
        return self.inner.reader(path)


def _save(checkpointer, path, step):
    checkpointer.save(path, _state(step), rank_state={}, metadata={"step": step, "full_state": True, "run_id": "r"})


def test_a_new_checkpoint_files_name_is_taken_from_the_save_call_and_the_commit_replaces_the_placeholder(tmp_path):
    storage = HeldStorage(FileStorage())
    checkpointer = AsyncCheckpointer(storage=storage)
    path = tmp_path / "model.ckpt"
    try:
        _save(checkpointer, path, 2)
        # What ModelCheckpoint.file_exists and any listing see while the write is in flight:
        assert os.path.exists(path) and is_placeholder(path) and is_ours(path)
        assert not is_committed(path) and not is_checkpoint_file(path) and list_committed(tmp_path) == []
        with pytest.raises(Exception):  # noqa: B017 - whatever torch says of a file that is no checkpoint
            torch.load(path, weights_only=True)
        assert cleanup_uncommitted(tmp_path) == [] and is_placeholder(path)  # never the save in flight
        storage.release.set()
        checkpointer.wait()
    finally:
        storage.release.set()
        checkpointer.close()
    assert is_checkpoint_file(path) and torch.load(path, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_a_new_checkpoint_folders_name_is_taken_from_the_save_call_by_the_folder_and_its_record(tmp_path):
    storage = HeldStorage(SnapshotStorage())
    checkpointer = AsyncCheckpointer(storage=storage)
    path = tmp_path / "model.ckpt"
    try:
        _save(checkpointer, path, 2)
        assert path.is_dir() and has_record(path) and not is_committed(path) and list_committed(tmp_path) == []
        storage.release.set()
        checkpointer.wait()
    finally:
        storage.release.set()
        checkpointer.close()
    assert is_committed(path) and not has_record(path)


class FailingFileStorage(FileStorage):
    def write(self, *args, **kwargs):
        raise OSError(28, "No space left on device")


def test_a_failed_save_leaves_neither_its_placeholder_nor_its_staging_folder(tmp_path):
    checkpointer = AsyncCheckpointer(storage=FailingFileStorage())
    try:
        _save(checkpointer, tmp_path / "model.ckpt", 2)
        with pytest.raises(OSError, match="No space"):
            checkpointer.wait()
    finally:
        checkpointer.close()
    assert list(tmp_path.iterdir()) == []


class DyingFileStorage(FileStorage):
    """Writes half of the checkpoint file, then the process is killed: a save interrupted mid-write."""

    def write(self, path, entries, *, group, document=None):
        super().write(path, entries, group=group, document=document)
        staged = next(path.glob("*.ckpt"))
        data = staged.read_bytes()
        staged.write_bytes(data[: len(data) // 2])
        kill_this_process()


def _save_once(path, step, storage=None):
    checkpointer = AsyncCheckpointer(storage=storage or FileStorage())
    try:
        _save(checkpointer, path, step)
    finally:
        checkpointer.close()


def test_a_save_killed_mid_write_leaves_a_placeholder_never_taken_for_a_checkpoint_and_removed_at_the_next_start(
    tmp_path,
):
    committed = tmp_path / "model.ckpt"
    _save_once(committed, 2)
    status = in_forked_child(lambda: _save_once(tmp_path / "model-v1.ckpt", 4, storage=DyingFileStorage()))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    leftover = tmp_path / "model-v1.ckpt"
    assert is_placeholder(leftover) and is_ours(leftover) and not is_committed(leftover)
    assert [c.path for c in list_committed(tmp_path)] == [committed]
    assert latest_committed(tmp_path).path == committed  # auto-resume's choice
    assert len(list(tmp_path.iterdir())) == 3  # the committed file, the placeholder, the staging folder
    cleanup_uncommitted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_a_lone_placeholder_is_removed_by_recovery_and_a_file_that_is_not_ours_is_left(tmp_path):
    assert write_placeholder(tmp_path / "a.ckpt", step=1, run_id=None)
    (tmp_path / "b.ckpt").write_bytes(b"lightning-ft placeholde")  # a user's file, not ours
    assert not write_placeholder(tmp_path / "b.ckpt", step=1, run_id=None)  # never overwrites anything
    assert recover_interrupted_swaps(tmp_path) == [tmp_path / "a.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt"]
    assert (tmp_path / "b.ckpt").read_bytes() == b"lightning-ft placeholde"
