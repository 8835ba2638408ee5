"""Fakes and helpers shared by the checkpoint tests: storage that fails or waits on demand, committed saves."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import torch

from lightning_ft.checkpoint import COMMIT_MARKER, METADATA_FILE, AsyncCheckpointer, SnapshotStorage


class FlakyStorage(SnapshotStorage):
    """Real storage, except that the next writes fail with the queued errors (a full disk, an I/O error)."""

    def __init__(self) -> None:
        self.failures: list[OSError] = []

    def write(self, path, entries, *, group):
        if self.failures:
            raise self.failures.pop(0)
        super().write(path, entries, group=group)


class GatedStorage(SnapshotStorage):
    """Real storage whose writes wait for a gate, recording the order of write starts and ends."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.log: list[str] = []

    def write(self, path, entries, *, group):
        self.log.append(f"start {Path(path).name}")
        self.started.set()
        self.gate.wait()
        super().write(path, entries, group=group)
        self.log.append(f"end {Path(path).name}")


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def save(path: Path, step: int, state: dict | None = None) -> Path:
    """A committed checkpoint at ``path`` holding ``state`` (default: ``{"w": full((4,), step)}``)."""
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(path, state or {"w": torch.full((4,), float(step))}, metadata={"step": step})
    finally:
        checkpointer.close()
    return path


def uncommitted(path: Path, step: int) -> Path:
    """A complete checkpoint at ``path`` whose commit marker is gone (an interrupted save)."""
    save(path, step)
    (path / COMMIT_MARKER).unlink()
    return path


def data_files(path: Path) -> list[Path]:
    """The tensor data files of checkpoint ``path``, smallest first."""
    ours = {COMMIT_MARKER, METADATA_FILE, ".snapshot_metadata"}
    return sorted((p for p in path.rglob("*") if p.is_file() and p.name not in ours), key=lambda p: p.stat().st_size)


class CreatesFileWhenUnpickled:
    """Unpickling it creates ``target``: proof that something was unpickled."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))
