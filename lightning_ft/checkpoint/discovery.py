"""Finding, checking and tidying checkpoints in a folder.

Auto-resume and retention use these: :func:`list_committed` and :func:`latest_committed` see only directories with a
commit marker (never the ``last`` link or a half-written save), :func:`verify` reads every shard through the
:class:`~lightning_ft.checkpoint.shard_reader.ShardReader` and checks it against the checksums recorded at save,
:func:`cleanup_uncommitted` removes failed or interrupted saves, and :func:`repoint_last` moves the ``last`` link
atomically so it always resolves to a committed checkpoint. :func:`newest_alternative` names the newest committed
checkpoint next to a refused one, for the loader's error messages. Nothing here is collective.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import COMMIT_MARKER, read_document
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage, fsync_dir

__all__ = [
    "COMMIT_MARKER",
    "CheckpointInfo",
    "cleanup_uncommitted",
    "is_committed",
    "latest_committed",
    "list_committed",
    "read_metadata",
    "repoint_last",
    "verify",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint found in a folder."""

    path: Path
    """The checkpoint directory."""
    step: int | None
    """Global step recorded in its metadata (``metadata["step"]``); ``None`` if the writer recorded none."""
    mtime: float
    """Modification time of its commit marker, Unix seconds; breaks ties between equal steps."""


def is_committed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory holding a commit marker (a link to one counts)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The run metadata of checkpoint ``path`` (``format_version``, ``step``, ``world_size``, and what the writer added).

    Works on uncommitted directories too (when their metadata file exists); raises :class:`CheckpointError` otherwise.
    """
    document = read_document(Path(path), require_commit=False)
    return json_codec.decode(document["metadata"])


def list_committed(dirpath: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints directly under ``dirpath``, by step ascending (``None`` first, then marker time).

    Symlinks (such as ``last``) and directories without a readable marker are skipped.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found = []
    for child in dirpath.iterdir():
        if child.is_symlink() or not child.is_dir() or not is_committed(child):
            continue
        try:
            # The marker repeats the step, so listing a folder of large checkpoints reads only small files.
            marker = child / COMMIT_MARKER
            step = json.loads(marker.read_bytes()).get("step")
            mtime = marker.stat().st_mtime
        except (ValueError, UnicodeDecodeError, AttributeError, OSError):
            continue
        found.append(CheckpointInfo(path=child, step=step if isinstance(step, int) else None, mtime=mtime))
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.mtime, c.path.name))


def latest_committed(dirpath: str | os.PathLike, *, exclude: Iterable[str | os.PathLike] = ()) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step under ``dirpath``, skipping paths in ``exclude``; or ``None``."""
    excluded = {Path(p).resolve() for p in exclude}
    for info in reversed(list_committed(dirpath)):
        if info.path.resolve() not in excluded:
            return info
    return None


def newest_alternative(path: str | os.PathLike) -> str:
    """Message suffix naming the newest committed checkpoint next to ``path`` (other than it), for error messages."""
    path = Path(path)
    alternative = latest_committed(path.parent, exclude=[path])
    if alternative is None:
        return f"; no committed checkpoint exists in {path.parent}"
    return f"; the newest committed checkpoint in {path.parent} is {alternative.path} (step {alternative.step})"


def verify(path: str | os.PathLike) -> list[str]:
    """Problems found in checkpoint ``path``: no marker, bad metadata, pickled entries, missing or corrupt shards.

    Reads every shard and checks its crc32 against the one recorded at save; returns ``[]`` when all is well. Not
    collective; any single process may call it.
    """
    path = Path(path)
    problems = []
    try:
        document = read_document(path, require_commit=False)
    except CheckpointError as e:
        return [str(e)]
    if not is_committed(path):
        problems.append(f"checkpoint {path} has no commit marker {COMMIT_MARKER}")
    try:
        reader = ShardReader(path, document, SnapshotStorage(), verify_checksums=True)
    except CheckpointError as e:
        return [*problems, str(e)]
    for key, record in document["tensors"].items():
        for shard in record["shards"]:
            try:
                reader.read_shard(key, record, shard)
            except CheckpointError as e:
                problems.append(str(e))
    return problems


def cleanup_uncommitted(dirpath: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Remove the directories under ``dirpath`` that have no commit marker, except those in ``keep``.

    Pass the in-flight save's path in ``keep``. Symlinks and plain files are left alone. Returns the removed paths.
    """
    dirpath = Path(dirpath)
    kept = {Path(p).resolve() for p in keep}
    removed = []
    if not dirpath.is_dir():
        return removed
    for child in sorted(dirpath.iterdir()):
        if child.is_symlink() or not child.is_dir() or is_committed(child) or child.resolve() in kept:
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    if removed:
        fsync_dir(dirpath)
    return removed


def repoint_last(dirpath: str | os.PathLike, target: str | os.PathLike, name: str = "last") -> Path:
    """Atomically point the link ``dirpath/name`` at ``target`` (a relative link); returns the link's path.

    A reader resolving the link at any moment sees either the old target or the new one, never a missing link.
    """
    dirpath, target = Path(dirpath), Path(target)
    link = dirpath / name
    # A relative target is taken relative to the current directory, like any path, unless only dirpath/target exists.
    if not target.is_absolute() and not target.exists():
        target = dirpath / target
    relative = os.path.relpath(os.path.abspath(target), os.path.abspath(dirpath))
    tmp = dirpath / f".{name}.tmp-{uuid.uuid4().hex}"
    os.symlink(relative, tmp, target_is_directory=True)
    os.replace(tmp, link)
    fsync_dir(dirpath)
    return link
