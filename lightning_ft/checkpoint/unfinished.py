"""Saves of ours that never committed, and whether the process that wrote each provably no longer runs.

A save leaves its in-progress record before any data (:mod:`~lightning_ft.checkpoint.in_progress`): in a placeholder
file at a checkpoint file's name, in a staging folder beside it, or in a folder checkpoint being written. The record
names the host and the process. :func:`unfinished_saves` lists them in one folder; :attr:`UnfinishedSave.writer_gone`
says whether nobody can finish one (its process ran on this host and is gone), which is what a caller needs before
deleting one while other processes of the job may write into the same folder (replica groups:
lightning_ft/replica/lost_writer.py). Never listed: a committed checkpoint, a save in flight in this process, what is
not ours.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.commit import COMMIT_MARKER
from lightning_ft.checkpoint.in_progress import PLACEHOLDER_MAGIC, in_flight_paths, is_placeholder, read_record
from lightning_ft.checkpoint.swap import swap_target

__all__ = ["UnfinishedSave", "unfinished_saves"]


@dataclass(frozen=True)
class UnfinishedSave:
    """A save of ours that never committed, and the process its record names."""

    path: Path
    host: str | None
    pid: int | None

    @property
    def writer_gone(self) -> bool:
        """Whether the process that wrote it provably no longer runs: it ran on this host and its pid is free."""
        if self.host != socket.gethostname() or self.pid is None or self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # a process of another user holds the pid: it runs
        return False


def _placeholder_record(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()[len(PLACEHOLDER_MAGIC) :]
        record = json.loads(data)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def unfinished_saves(folder: Path) -> list[UnfinishedSave]:
    """The saves of ours under ``folder`` that have not committed, outside this process's saves in flight: placeholder
    files, and folders (staging ones included) that hold our in-progress record and no commit marker."""
    if not folder.is_dir():
        return []
    in_flight = in_flight_paths()
    found = []
    for child in sorted(folder.iterdir()):
        if child.is_symlink() or Path(os.path.abspath(swap_target(child))) in in_flight:
            continue
        if is_placeholder(child):
            record = _placeholder_record(child)
        elif child.is_dir() and not (child / COMMIT_MARKER).is_file():
            record = read_record(child)
            if record is None:
                continue  # not ours (user files, another tool's checkpoint): never touched
        else:
            continue
        pid = record.get("pid")
        host = record.get("host")
        found.append(
            UnfinishedSave(
                child,
                str(host) if isinstance(host, str) else None,
                pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            )
        )
    return found
