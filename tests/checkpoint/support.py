"""Fakes and helpers shared by the checkpoint tests: storage that fails or waits on demand, committed saves.

The fakes wrap the storage of the on-disk format under test (:func:`format_storage`): torchsnapshot by default, DCP in
the tests that the ``checkpoint_format`` fixture (tests/checkpoint/conftest.py) runs against both formats.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import threading
from pathlib import Path

import torch
import yaml

from lightning_ft.checkpoint import AsyncCheckpointer, in_progress
from lightning_ft.checkpoint.internal import COMMIT_MARKER, METADATA_FILE, storage_named
from lightning_ft.checkpoint.storage.dcp_storage import ENTRIES_FILE

_format = ["torchsnapshot"]  # replaced by the checkpoint_format fixture for the duration of a test


def checkpoint_format() -> str:
    """The on-disk format the current test writes (``"torchsnapshot"`` or ``"dcp"``)."""
    return _format[0]


def format_storage():
    """A new real storage of the format under test."""
    return storage_named(_format[0])


def format_storage_class() -> type:
    """The class of :func:`format_storage` (for tests that patch its ``write``)."""
    return type(format_storage())


class StorageWrapper:
    """The storage of the format under test, delegated to; fakes override ``write``."""

    def __init__(self, inner=None) -> None:
        self.inner = inner if inner is not None else format_storage()

    def write(self, path, entries, *, group, **kwargs):
        self.inner.write(path, entries, group=group, **kwargs)

    def reader(self, path):
        return self.inner.reader(path)


class FlakyStorage(StorageWrapper):
    """Real storage, except that the next writes fail with the queued errors (a full disk, an I/O error)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[OSError] = []

    def write(self, path, entries, *, group, **kwargs):
        if self.failures:
            raise self.failures.pop(0)
        super().write(path, entries, group=group, **kwargs)


class GatedStorage(StorageWrapper):
    """Real storage whose writes wait for a gate, recording the order of write starts and ends."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()
        self.log: list[str] = []

    def write(self, path, entries, *, group, **kwargs):
        self.log.append(f"start {Path(path).name}")
        self.started.set()
        self.gate.wait()
        super().write(path, entries, group=group, **kwargs)
        self.log.append(f"end {Path(path).name}")


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def save(path: Path, step: int, state: dict | None = None, *, metadata: dict | None = None) -> Path:
    """A committed checkpoint at ``path`` holding ``state`` (default: ``{"w": full((4,), step)}``); ``metadata``
    defaults to ``{"step": step}``."""
    checkpointer = AsyncCheckpointer(storage=format_storage())
    try:
        state = state or {"w": torch.full((4,), float(step))}
        checkpointer.save(path, state, metadata={"step": step} if metadata is None else metadata)
    finally:
        checkpointer.close()
    return path


def uncommitted(path: Path, step: int) -> Path:
    """A complete checkpoint at ``path`` whose commit marker was never written (a save interrupted just before it):
    it still holds its in-progress record."""
    save(path, step)
    in_progress.write_record(path, target=path, step=step, run_id=None)
    (path / COMMIT_MARKER).unlink()
    return path


def data_files(path: Path) -> list[Path]:
    """The tensor data files of checkpoint ``path``, smallest first (either format's own metadata excluded); a
    checkpoint file is its own data file."""
    if path.is_file():
        return [path]
    ours = {
        COMMIT_MARKER,
        METADATA_FILE,
        in_progress.IN_PROGRESS_RECORD,
        ".snapshot_metadata",
        ".metadata",
        ENTRIES_FILE,
    }
    return sorted((p for p in path.rglob("*") if p.is_file() and p.name not in ours), key=lambda p: p.stat().st_size)


def flip_a_byte_of(path: Path, value: torch.Tensor) -> Path:
    """Flip one byte inside the stored bytes of tensor ``value`` in checkpoint ``path`` (either format: a DCP file also
    holds zip framing around the tensor bytes); returns the damaged file."""
    wanted = value.detach().contiguous().view(torch.uint8).numpy().tobytes()
    for file in data_files(path):
        raw = bytearray(file.read_bytes())
        at = bytes(raw).find(wanted)
        if at >= 0:
            raw[at + len(wanted) // 2] ^= 0xFF
            file.write_bytes(bytes(raw))
            return file
    raise AssertionError(f"no data file of {path} holds the tensor's bytes")


class CreatesFileWhenUnpickled:
    """Unpickling it creates ``target``: proof that something was unpickled."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def in_forked_child(fn) -> int:
    """Run ``fn`` in a forked copy of this process and return its wait status (``fn`` may kill it).

    The copy never returns to the caller's code: it exits right after ``fn`` (status 0, or 1 if ``fn`` raised).
    """
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def kill_this_process() -> None:
    """Die at once, as under ``kill -9``: nothing after this line runs, no cleanup, no ``finally``."""
    os.kill(os.getpid(), signal.SIGKILL)


def plant_pickled_entry(path: Path, payload: object) -> None:
    """Add a torchsnapshot object entry ``0/shards/evil`` to checkpoint ``path`` whose file is ``payload`` pickled:
    what a malicious checkpoint would hold. lightning-ft must refuse it without unpickling."""
    (path / "0").mkdir(exist_ok=True)
    (path / "0" / "evil").write_bytes(pickle.dumps(payload))
    manifest = yaml.safe_load((path / ".snapshot_metadata").read_text())
    manifest["manifest"]["0/shards/evil"] = {
        "type": "object",
        "location": "0/evil",
        "serializer": "torch_save",
        "obj_type": "builtins.object",
        "replicated": False,
    }
    (path / ".snapshot_metadata").write_text(json.dumps(manifest))


def folders_only(why: str = "it checks the files inside a checkpoint folder") -> None:
    """Skip the current test for the single-file format (``"file"``): ``why`` says what it checks that a file has not
    (the folder's own files, several processes writing one checkpoint)."""
    if _format[0] == "file":
        import pytest

        pytest.skip(f"a checkpoint file has no such thing: {why}")
