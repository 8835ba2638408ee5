"""A committed checkpoint is only ever replaced by a committed one: the new one is written beside it and swapped in
once durable. A crash at any instant leaves the old or the new one committed, and recovery puts it at its path."""

from __future__ import annotations

import errno
import os
import shutil
import signal

import pytest
import torch

from lightning_ft.checkpoint import (
    AsyncCheckpointer,
    cleanup_uncommitted,
    in_progress,
    list_committed,
    load_checkpoint,
    recover_interrupted_swaps,
    swap,
    verify,
)
from lightning_ft.checkpoint import async_checkpointer as writer_module
from lightning_ft.checkpoint.internal import IN_PROGRESS_RECORD, is_committed
from tests.checkpoint.support import (
    FlakyStorage,
    GatedStorage,
    StorageWrapper,
    enospc,
    folders_only,
    in_forked_child,
    kill_this_process,
    save,
)

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format

TOKEN = "0123456789abcdef"


def committed_steps(folder):
    return [(c.path.name, c.step) for c in list_committed(folder)]


def test_a_checkpoint_being_replaced_stays_committed_and_loadable_until_the_new_one_is_durable(tmp_path):
    path = save(tmp_path / "c", 1)
    storage = GatedStorage()
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(path, {"w": torch.full((4,), 2.0)}, metadata={"step": 2})
        storage.started.wait()
        # The new state is being written: the old one is where it was, committed and whole.
        assert is_committed(path) and verify(path) == []
        assert torch.equal(load_checkpoint(path).state["w"], torch.full((4,), 1.0))
        assert committed_steps(tmp_path) == [("c", 1)]
        storage.gate.set()
        checkpointer.wait()
    finally:
        storage.gate.set()
        checkpointer.close()
    assert torch.equal(load_checkpoint(path).state["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_full_disk_while_replacing_a_checkpoint_leaves_the_old_one_committed_and_loadable(tmp_path):
    path = save(tmp_path / "c", 1)
    storage = FlakyStorage()
    storage.failures.append(enospc())
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(path, {"w": torch.full((4,), 2.0)}, metadata={"step": 2})
        with pytest.raises(OSError) as raised:
            checkpointer.wait()
        assert raised.value.errno == errno.ENOSPC
    finally:
        checkpointer.close()
    assert is_committed(path) and verify(path) == []
    assert torch.equal(load_checkpoint(path).state["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the failed new one is gone


def test_a_save_whose_commit_callback_fails_is_undone_and_the_checkpoint_it_replaced_comes_back(tmp_path):
    path = save(tmp_path / "c", 1)
    seen_by_callback = []

    def on_commit(info):
        seen_by_callback.append(load_checkpoint(info.path).metadata["step"])
        raise ValueError("event log full")

    checkpointer = AsyncCheckpointer(on_commit=on_commit)
    try:
        checkpointer.save(path, {"w": torch.full((4,), 2.0)}, metadata={"step": 2})
        with pytest.raises(ValueError, match="event log full"):
            checkpointer.wait()
    finally:
        checkpointer.close()
    assert seen_by_callback == [2]  # the callback saw the new checkpoint in place
    assert committed_steps(tmp_path) == [("c", 1)]
    assert torch.equal(load_checkpoint(path).state["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_save_to_a_path_lightning_ft_did_not_write_fails_and_touches_nothing(tmp_path):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "data.bin").write_bytes(b"theirs")
    (tmp_path / "file.ckpt").write_bytes(b"a Lightning checkpoint file")
    os.symlink("foreign", tmp_path / "link")
    checkpointer = AsyncCheckpointer()
    try:
        for name in ("foreign", "file.ckpt", "link"):
            checkpointer.save(tmp_path / name, {"w": torch.ones(2)})
            with pytest.raises(Exception, match=f"cannot save to .*{name}"):
                checkpointer.wait()
    finally:
        checkpointer.close()
    assert (tmp_path / "foreign" / "data.bin").read_bytes() == b"theirs"
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == ["data.bin"]
    assert (tmp_path / "file.ckpt").read_bytes() == b"a Lightning checkpoint file"
    assert os.readlink(tmp_path / "link") == "foreign"


class Crash(BaseException):
    """Stands for the process dying at this instant: nothing after it runs."""


def _crash_at(monkeypatch, index: int) -> list[str]:
    """Make the ``index``-th filesystem step of a swap (rename, or a step of deleting the old one) crash."""
    steps: list[str] = []

    def step(name, fn):
        def wrapped(*args, **kwargs):
            if len(steps) == index:
                raise Crash(name)
            steps.append(name)
            return fn(*args, **kwargs)

        return wrapped

    def rmtree_halfway(path, *args, **kwargs):
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for f in files[: len(files) // 2]:
            f.unlink()
        raise Crash("rmtree")

    monkeypatch.setattr(swap, "_rename", step("rename", swap._rename))
    monkeypatch.setattr(swap, "write_record", step("record", swap.write_record))
    monkeypatch.setattr(swap, "uncommit", step("uncommit", swap.uncommit))
    monkeypatch.setattr(in_progress, "write_record", step("record", in_progress.write_record))
    monkeypatch.setattr(in_progress, "uncommit", step("uncommit", in_progress.uncommit))
    monkeypatch.setattr(in_progress.shutil, "rmtree", step("rmtree", rmtree_halfway if index == 4 else shutil.rmtree))
    return steps


# 0: before the old one moves aside; 1: between the renames; 2-4: while the old one is deleted (record written,
# marker removed, files half deleted); 5: no crash.
@pytest.mark.parametrize("crash_at", range(6))
def test_a_crash_at_any_step_of_a_swap_leaves_the_new_checkpoint_committed_at_its_path_after_recovery(
    tmp_path, monkeypatch, crash_at
):
    folders_only()
    target = save(tmp_path / "c", 1)
    staged = save(swap.swap_path(target, "new", TOKEN), 2)
    steps = _crash_at(monkeypatch, crash_at)
    replacement = swap.Swap(staged, target)
    try:
        replacement.swap()
        replacement.finish()
    except Crash:
        pass
    monkeypatch.undo()
    assert len(steps) == min(crash_at, 5)
    # Whatever the instant, a committed checkpoint exists somewhere; recovery puts the newest at its path.
    recover_interrupted_swaps(tmp_path)
    assert committed_steps(tmp_path) == [("c", 2)]
    assert torch.equal(load_checkpoint(target).state["w"], torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_recovery_keeps_the_old_checkpoint_when_the_new_one_never_committed(tmp_path):
    target = save(tmp_path / "c", 1)
    staged = swap.swap_path(target, "new", TOKEN)
    staged.mkdir()
    (staged / IN_PROGRESS_RECORD).write_text("{}")
    (staged / "batched").mkdir()
    (staged / "batched" / "0").write_bytes(b"half")
    assert cleanup_uncommitted(tmp_path) == []  # recovery settled it first
    assert committed_steps(tmp_path) == [("c", 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# 0: before the new one gets its record back; 1: before its marker goes; 2: before it moves aside; 3-4: while it is
# deleted (marker, files half deleted); 5: before the old one moves back.
@pytest.mark.parametrize("crash_at", range(6))
def test_a_crash_while_undoing_a_failed_save_leaves_a_committed_checkpoint_at_its_path_after_recovery(
    tmp_path, monkeypatch, crash_at
):
    folders_only()
    target = save(tmp_path / "c", 1)
    staged = save(swap.swap_path(target, "new", TOKEN), 2)
    replacement = swap.Swap(staged, target)
    replacement.swap()
    # Undo: record into the new one, its marker removed, it moves aside, is deleted; the old one moves back.
    steps = _crash_at(monkeypatch, crash_at)
    try:
        replacement.undo()
    except Crash:
        pass
    monkeypatch.undo()
    recover_interrupted_swaps(tmp_path)
    expected = 2 if crash_at <= 1 else 1  # until its marker is gone, the new one is the newest committed
    assert len(steps) == crash_at
    assert committed_steps(tmp_path) == [("c", expected)]
    assert load_checkpoint(target).metadata["step"] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


class _PartialWrite(StorageWrapper):
    def write(self, path, entries, *, group, **kwargs):
        super().write(path, dict(list(entries.items())[:1]), group=group, **kwargs)
        kill_this_process()


def _kill_at_rename(number: int):
    calls = []
    real = swap._rename

    def rename(source, destination):
        calls.append(source)
        if len(calls) == number:
            kill_this_process()
        real(source, destination)

    swap._rename = rename


@pytest.mark.parametrize(
    ("kill_at", "expected_step"),
    [("data write", 1), ("first rename", 2), ("second rename", 2), ("deleting the old one", 2)],
)
def test_a_process_killed_while_replacing_a_checkpoint_leaves_one_that_recovery_restores(
    tmp_path, kill_at, expected_step
):
    folders_only()
    path = save(tmp_path / "c", 1, {"w": torch.full((4,), 1.0), "b": torch.arange(1000.0)})

    def replace_and_die():
        storage = _PartialWrite() if kill_at == "data write" else None
        if kill_at == "first rename":
            _kill_at_rename(1)
        elif kill_at == "second rename":
            _kill_at_rename(2)
        elif kill_at == "deleting the old one":
            writer_module.discard = lambda folder: kill_this_process()
        checkpointer = AsyncCheckpointer(storage=storage)
        state = {"w": torch.full((4,), 2.0), "b": torch.arange(1000.0) + 2}
        checkpointer.save(path, state, metadata={"step": 2})
        checkpointer.wait()

    status = in_forked_child(replace_and_die)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    # What the next start does on rank 0 before listing checkpoints.
    recover_interrupted_swaps(tmp_path)
    cleanup_uncommitted(tmp_path)
    assert committed_steps(tmp_path) == [("c", expected_step)]
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.state["w"], torch.full((4,), float(expected_step)))
    assert torch.equal(loaded.state["b"], torch.arange(1000.0) + (expected_step - 1) * 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_discovery_never_lists_the_folders_of_a_replacement(tmp_path):
    save(tmp_path / "c", 1)
    save(swap.swap_path(tmp_path / "c", "new", TOKEN), 2)
    save(swap.swap_path(tmp_path / "d", "old", TOKEN), 3)
    assert committed_steps(tmp_path) == [("c", 1)]
