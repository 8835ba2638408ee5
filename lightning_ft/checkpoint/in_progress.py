"""What lightning-ft may delete: folders it can prove it wrote, never a save in flight.

A checkpoint folder is lightning-ft's when it holds one of two files of ours:

- the commit marker (``lightning_ft.committed``): a committed checkpoint;
- the in-progress record (``lightning_ft.in_progress``): rank 0 writes it durably into the folder before any byte of
  data, naming the run, the step, the host and the process, and removes it once the marker is durable. A folder holding
  the record and no marker is a save that never finished (a crash, a kill, a full disk).

A checkpoint file's path is held from the save call on by a placeholder (:func:`write_placeholder`): a small file that
starts with :data:`PLACEHOLDER_MAGIC` and holds the same record, so that Lightning's ``ModelCheckpoint`` sees its
name taken (its version counter) while the file is written beside it; the commit replaces it atomically. A
placeholder is never a checkpoint (it is no zip), and one that no save in flight holds is a leftover of ours.

Nothing else is ours: a folder without either file (user files, a ``.git``, another tool's checkpoint, lightning-ft's
own event log) is never deleted, whatever its name. :func:`discard` deletes a folder of ours so that it never looks
committed while half deleted: it writes the record first, then removes the marker, then the files.

The saves in flight in this process are registered here (:func:`mark_in_flight`), so that cleanup and recovery skip
them whatever their caller passes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.commit import COMMIT_MARKER, atomic_write, uncommit
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from lightning_ft.checkpoint.snapshot_storage import fsync_dir

__all__ = [
    "IN_PROGRESS_RECORD",
    "PLACEHOLDER_MAGIC",
    "discard",
    "has_record",
    "in_flight_paths",
    "is_ours",
    "is_placeholder",
    "make_durable",
    "mark_in_flight",
    "read_record",
    "remove_record",
    "unmark_in_flight",
    "write_placeholder",
    "write_record",
]

IN_PROGRESS_RECORD = "lightning_ft.in_progress"
"""File name of the in-progress record inside a checkpoint folder being written."""

PLACEHOLDER_MAGIC = b"lightning-ft placeholder\n"
"""How a placeholder file begins (then the in-progress record as JSON)."""

_lock = threading.Lock()
_in_flight: Counter[Path] = Counter()


def _record(target: Path, step: int | None, run_id: str | None) -> dict[str, Any]:
    return {
        "target": target.name,
        "step": step,
        "run_id": run_id,
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def write_record(folder: Path, *, target: Path, step: int | None, run_id: str | None, durable: bool = True) -> None:
    """Write the in-progress record into ``folder``, durably (file and folder entry). Rank 0, before any data.

    ``durable=False`` (a save call that must not wait for the disk) leaves the fsyncs to :func:`make_durable`."""
    data = json.dumps(_record(target, step, run_id)).encode()
    if durable:
        atomic_write(folder / IN_PROGRESS_RECORD, data)
    else:
        (folder / IN_PROGRESS_RECORD).write_bytes(data)  # a new folder: nobody reads a record there before this


def write_placeholder(path: Path, *, step: int | None, run_id: str | None, durable: bool = True) -> bool:
    """Hold the checkpoint file name ``path`` for a save in flight: create a placeholder there unless something (a
    file, a folder, a link) is there already. Returns whether it created one. Rank 0, in the save call.

    ``O_EXCL``: a file that appears at ``path`` meanwhile is never overwritten. ``durable=False`` leaves the fsyncs
    to :func:`make_durable` (the background writer's, before any data): a killed process leaves the placeholder whole
    (the page cache survives it), and the save call does not wait for the disk."""
    if path.exists() or path.is_symlink():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    data = PLACEHOLDER_MAGIC + json.dumps(_record(path, step, run_id)).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if durable:
        fsync_dir(path.parent)
    return True


def make_durable(path: Path) -> None:
    """fsync what ``durable=False`` left: a placeholder file ``path`` or the in-progress record of the folder
    ``path``, and their folder entries."""
    target = path / IN_PROGRESS_RECORD if path.is_dir() else path
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if path.is_dir():
        fsync_dir(path)
    fsync_dir(path.parent)


def is_placeholder(path: Path) -> bool:
    """Whether ``path`` is a placeholder file of ours (see :func:`write_placeholder`), not a link."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(PLACEHOLDER_MAGIC)) == PLACEHOLDER_MAGIC
    except OSError:
        return False


def read_record(folder: Path) -> dict[str, Any] | None:
    """The in-progress record of ``folder``, or ``None`` if it has none (an unreadable record counts as one)."""
    try:
        data = (folder / IN_PROGRESS_RECORD).read_bytes()
    except OSError:
        return None
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def has_record(folder: Path) -> bool:
    """Whether ``folder`` holds an in-progress record."""
    return (folder / IN_PROGRESS_RECORD).is_file()


def remove_record(folder: Path) -> None:
    """Remove the in-progress record of ``folder`` (after its marker is durable)."""
    (folder / IN_PROGRESS_RECORD).unlink(missing_ok=True)
    fsync_dir(folder)


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a folder (not a link) holding our commit marker or our in-progress record, a checkpoint
    file lightning-ft wrote (:func:`~lightning_ft.checkpoint.single_file.is_checkpoint_file`) or a placeholder."""
    if path.is_symlink():
        return False
    if path.is_file():
        return is_placeholder(path) or is_checkpoint_file(path)
    if not path.is_dir():
        return False
    return (path / COMMIT_MARKER).is_file() or has_record(path)


def discard(folder: Path) -> None:
    """Delete ``folder``, a folder of ours, so that no moment of it looks committed: record, no marker, no files; or
    a checkpoint file or placeholder of ours.

    Does nothing if ``folder`` does not exist. A crash in the middle leaves a folder holding the record, which the next
    cleanup removes.

    Raises:
        ValueError: ``folder`` is not ours (see :func:`is_ours`).
        OSError: the filesystem refused.
    """
    if not folder.exists() and not folder.is_symlink():
        return
    if not is_ours(folder):
        raise ValueError(f"{folder} is not a lightning-ft checkpoint folder; it is left alone")
    if folder.is_file():
        folder.unlink()  # a checkpoint file: one unlink, it is there whole or not at all
        fsync_dir(folder.parent)
        return
    if not has_record(folder):
        write_record(folder, target=folder, step=None, run_id=None)
    uncommit(folder)
    shutil.rmtree(folder)
    fsync_dir(folder.parent)


def _key(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(path))


def mark_in_flight(path: str | os.PathLike) -> None:
    """Register ``path`` as the target of a save in flight in this process (until :func:`unmark_in_flight`)."""
    with _lock:
        _in_flight[_key(path)] += 1


def unmark_in_flight(path: str | os.PathLike) -> None:
    """Undo one :func:`mark_in_flight` of ``path``."""
    with _lock:
        key = _key(path)
        _in_flight[key] -= 1
        if _in_flight[key] <= 0:
            del _in_flight[key]


def in_flight_paths() -> set[Path]:
    """Absolute target paths of the saves in flight in this process."""
    with _lock:
        return set(_in_flight)
