"""lightning-ft deletes only what it can prove it wrote (its in-progress record), never a save in flight."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, cleanup_uncommitted, list_committed, load_checkpoint
from lightning_ft.checkpoint.internal import IN_PROGRESS_RECORD, is_committed
from tests.checkpoint.support import (
    GatedStorage,
    StorageWrapper,
    folders_only,
    in_forked_child,
    kill_this_process,
    save,
)

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


class RecordingStorage(StorageWrapper):
    """Real storage that notes what the checkpoint folder holds when the first byte of data is about to be written."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict = {}

    def write(self, path, entries, *, group, **kwargs):
        self.seen["files"] = sorted(p.name for p in path.iterdir())
        self.seen["record"] = json.loads((path / IN_PROGRESS_RECORD).read_text())
        super().write(path, entries, group=group, **kwargs)


def test_the_in_progress_record_names_the_save_before_any_data_is_written_and_goes_at_commit(tmp_path):
    storage = RecordingStorage()
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(tmp_path / "step=5", {"w": torch.ones(4)}, metadata={"step": 5, "run_id": "run-abc"})
    finally:
        checkpointer.close()
    assert storage.seen["files"] == [IN_PROGRESS_RECORD]  # nothing else in the folder yet
    record = storage.seen["record"]
    assert record["step"] == 5 and record["run_id"] == "run-abc" and record["target"] == "step=5"
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and record["time"] > 0
    assert is_committed(tmp_path / "step=5") and not (tmp_path / "step=5" / IN_PROGRESS_RECORD).exists()


def _folder_with_files(path, files: dict[str, bytes]):
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_cleanup_removes_only_interrupted_saves_of_ours_and_says_once_what_it_left_alone(tmp_path, caplog):
    foreign = {
        "src": {"train.py": b"print('hello')\n"},
        "data": {"train.bin": b"\x00\x01"},
        ".git": {"HEAD": b"ref: refs/heads/main\n"},
        "dcp-checkpoint": {".metadata": b"dcp", "__0_0.distcp": b"shard"},  # another tool's checkpoint
        "lightning-ft": {"events/rank0.jsonl": b'{"event": "attempt_start"}\n'},  # our own event log
        "epoch=0-step=9.ckpt": {"batched/0": b"partial"},  # no record: cannot be proven ours
    }
    for name, files in foreign.items():
        _folder_with_files(tmp_path / name, files)
    (tmp_path / "notes.txt").write_text("mine")
    committed = save(tmp_path / "epoch=0-step=2.ckpt", 2)
    interrupted = tmp_path / "epoch=0-step=4.ckpt"
    interrupted.mkdir()
    (interrupted / IN_PROGRESS_RECORD).write_text(json.dumps({"target": interrupted.name, "step": 4}))
    _folder_with_files(interrupted, {"batched/0": b"half of the data"})

    with caplog.at_level(logging.WARNING, logger="lightning_ft"):
        assert cleanup_uncommitted(tmp_path) == [interrupted]
        assert cleanup_uncommitted(tmp_path) == []
    assert not interrupted.exists()
    for name, files in foreign.items():
        for file, data in files.items():
            assert (tmp_path / name / file).read_bytes() == data, f"{name}/{file} was touched"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert is_committed(committed) and load_checkpoint(committed).metadata["step"] == 2
    # Once, however often cleanup runs (DCP's own debug lines are not ours).
    [message] = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_ft")]
    assert "left alone" in message and ".git" in message and "dcp-checkpoint" in message


def test_cleanup_never_removes_a_save_in_flight_even_when_the_caller_does_not_name_it(tmp_path):
    folders_only()
    save(tmp_path / "replaced", 1)
    storage = GatedStorage()
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(tmp_path / "fresh", {"w": torch.ones(4)}, metadata={"step": 2})
        storage.started.wait()
        assert cleanup_uncommitted(tmp_path) == []
        assert (tmp_path / "fresh").is_dir()
        storage.gate.set()
        checkpointer.wait()
        # A save over a committed checkpoint is written beside it: that folder is in flight too.
        storage.gate.clear()
        storage.started.clear()
        checkpointer.save(tmp_path / "replaced", {"w": torch.full((4,), 3.0)}, metadata={"step": 3})
        storage.started.wait()
        assert cleanup_uncommitted(tmp_path) == []
        storage.gate.set()
        checkpointer.wait()
    finally:
        storage.gate.set()
        checkpointer.close()
    assert [(c.path.name, c.step) for c in list_committed(tmp_path)] == [("fresh", 2), ("replaced", 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "replaced"]


class DyingStorage(StorageWrapper):
    """Writes the first of this rank's entries, then the process is killed: a save interrupted mid-write."""

    def write(self, path, entries, *, group, **kwargs):
        first = dict(list(entries.items())[:1])
        super().write(path, first, group=group, **kwargs)
        kill_this_process()


def test_a_save_killed_mid_write_leaves_a_folder_of_ours_that_the_next_cleanup_removes(tmp_path):
    folders_only()
    save(tmp_path / "step=1", 1)

    def killed_mid_save():
        checkpointer = AsyncCheckpointer(storage=DyingStorage())
        checkpointer.save(tmp_path / "step=2", {"a": torch.ones(1000), "b": torch.ones(1000)}, metadata={"step": 2})
        checkpointer.wait()

    status = in_forked_child(killed_mid_save)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    leftover = tmp_path / "step=2"
    assert (leftover / IN_PROGRESS_RECORD).is_file() and not is_committed(leftover)
    assert cleanup_uncommitted(tmp_path) == [leftover]
    assert [c.step for c in list_committed(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=1"]
