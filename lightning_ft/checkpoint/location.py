"""What a checkpoint path is, decided once, where a load starts.

A path handed to a load can be many things: a lightning-ft folder (committed or not), a ``last`` link to one (whose
target may never have committed), an object-store URL, a Lightning ``.ckpt`` file, a ``ModelParallelStrategy``
distributed-checkpoint folder. :func:`locate` looks at the path once and returns a :class:`CheckpointLocation` that
says which it is and which checkpoint it resolved to; every reader after it (the strategy's load, the fallback loop,
:func:`~lightning_ft.checkpoint.load_checkpoint`, the import of another strategy's checkpoint) takes that value
instead of asking the filesystem again. Candidates found by listing a folder are located without I/O
(:func:`listed`): the listing already said what they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_ft.checkpoint.commit import METADATA_FILE
from lightning_ft.checkpoint.dcp_folder import is_dcp_folder
from lightning_ft.checkpoint.discovery import COMMIT_MARKER, is_committed, latest_committed, newest_alternative
from lightning_ft.checkpoint.errors import CheckpointNotFoundError, UncommittedCheckpointError
from lightning_ft.checkpoint.in_progress import IN_PROGRESS_RECORD
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from lightning_ft.checkpoint.storage.dcp_storage import ENTRIES_FILE
from lightning_ft.checkpoint.storage.object_store import ObjectStore, as_url, is_remote

__all__ = [
    "CheckpointLocation",
    "Kind",
    "existing_ancestor",
    "is_last_path",
    "is_lightning_ft_checkpoint",
    "listed",
    "locate",
]

Kind = Literal["lightning_ft", "dcp_folder", "lightning_file"]
"""``"lightning_ft"``: a committed checkpoint lightning-ft wrote (read by ``load_checkpoint``); ``"dcp_folder"``: a
distributed-checkpoint folder of another strategy; ``"lightning_file"``: a file (a Lightning ``.ckpt``), imported."""

_LAST_NAME = re.compile(r"^last(-v?\d+)?$")


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint path, classified: what was asked for, what it resolved to, and what it is."""

    requested: Path
    """The path as given (``ckpt_path``, or a candidate found by listing)."""
    path: Path
    """The checkpoint to read: ``requested`` itself, the target of a ``last`` link, or the newest committed
    checkpoint beside a ``last`` whose target never committed."""
    kind: Kind
    """What ``path`` holds (see :data:`Kind`)."""
    remote: bool
    """Whether ``path`` is an object-store URL."""
    note: str | None = None
    """A line for the user when the resolution is not what was asked (``requested`` pointed at a save that never
    committed, so an older checkpoint is read instead); ``None`` otherwise."""

    @property
    def ours(self) -> bool:
        """Whether lightning-ft wrote it (committed, read by ``load_checkpoint``), rather than another strategy."""
        return self.kind == "lightning_ft"


def existing_ancestor(path: Path) -> Path:
    """``path`` if it exists, else its nearest parent that does (a checkpoint folder whose missing parents the first save
    makes, as Lightning's checkpoint I/O does). A link counts as existing, dangling or not."""
    path = Path(path)
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    return path


def is_last_path(path: Path) -> bool:
    """Whether Lightning routes a save to ``path`` as its ``last`` checkpoint (``last.ckpt``, ``last-v1.ckpt``, with
    any ``ModelCheckpoint.FILE_EXTENSION``)."""
    return bool(_LAST_NAME.match(path.name.removesuffix(".ckpt")) or _LAST_NAME.match(path.stem))


def is_lightning_ft_checkpoint(path: Path) -> bool:
    """A folder that lightning-ft wrote (committed or not): it holds our metadata, our marker, our in-progress record
    or snapshot data; or an object-store checkpoint holding our marker or a generation of ours."""
    if is_remote(path):
        return ObjectStore().is_ours(path)
    if path.is_file():
        return is_checkpoint_file(path)
    if not path.is_dir():
        return False
    names = (METADATA_FILE, COMMIT_MARKER, IN_PROGRESS_RECORD, ".snapshot_metadata", "batched", ENTRIES_FILE)
    return any((path / name).exists() for name in names) or any(p.name.isdigit() for p in path.iterdir())


def listed(path: Path, *, ours: bool) -> CheckpointLocation:
    """The location of a checkpoint a listing found: committed and ours (``ours=True``), or another strategy's file or
    distributed-checkpoint folder; no I/O beyond telling a folder from a file for the latter."""
    remote = is_remote(path)
    if ours:
        return CheckpointLocation(path, path, "lightning_ft", remote)
    return CheckpointLocation(path, path, "dcp_folder" if not remote and path.is_dir() else "lightning_file", remote)


def locate(path: Path) -> CheckpointLocation:
    """Classify ``path`` (a ``ckpt_path`` after Lightning resolved ``"last"``/``"best"``) before anything loads.

    Raises:
        CheckpointNotFoundError: nothing exists at ``path`` (also a ``FileNotFoundError``).
        UncommittedCheckpointError: ``path`` is a lightning-ft checkpoint without its commit marker, a ``last`` link
            to one while no committed checkpoint exists beside it, or a folder that is neither a lightning-ft nor a
            distributed checkpoint.
    """
    path = Path(path)
    if is_remote(path):
        return _locate_remote(path)
    if path.is_symlink():
        target = path.resolve()
        if target.exists() and is_committed(target):
            return CheckpointLocation(path, target, "lightning_ft", remote=False)
        latest = latest_committed(path.parent)
        if latest is None:
            raise UncommittedCheckpointError(
                f"ckpt_path={str(path)!r} points at {str(target)!r}, which is not committed"
            )
        note = f"{path} points at an uncommitted checkpoint; resuming from {latest.path} instead"
        return CheckpointLocation(path, latest.path, "lightning_ft", remote=False, note=note)
    if not path.exists():
        raise CheckpointNotFoundError(f"ckpt_path={str(path)!r} does not exist{newest_alternative(path)}")
    if is_lightning_ft_checkpoint(path):
        if not is_committed(path):
            raise UncommittedCheckpointError(
                f"ckpt_path={str(path)!r} is a lightning-ft checkpoint without its commit marker (its save never"
                f" finished){newest_alternative(path)}"
            )
        return CheckpointLocation(path, path, "lightning_ft", remote=False)
    if path.is_dir():
        if not is_dcp_folder(path):
            raise UncommittedCheckpointError(
                f"ckpt_path={str(path)!r} is a folder but neither a lightning-ft checkpoint nor a distributed checkpoint"
                " (no .metadata file)"
            )
        return CheckpointLocation(path, path, "dcp_folder", remote=False)
    return CheckpointLocation(path, path, "lightning_file", remote=False)


def _locate_remote(path: Path) -> CheckpointLocation:
    # An object store has no `last` link: a `last*.ckpt` path that holds no committed checkpoint means the newest one
    # found by listing the markers beside it.
    if is_committed(path):
        return CheckpointLocation(path, path, "lightning_ft", remote=True)
    if is_last_path(path):
        latest = latest_committed(path.parent)
        if latest is not None:
            return CheckpointLocation(path, latest.path, "lightning_ft", remote=True)
    if not ObjectStore().exists(path):
        raise CheckpointNotFoundError(f"ckpt_path={as_url(path)!r} does not exist{newest_alternative(path)}")
    if is_lightning_ft_checkpoint(path):
        raise UncommittedCheckpointError(
            f"ckpt_path={as_url(path)!r} is a lightning-ft checkpoint without its commit marker (its save never"
            f" finished){newest_alternative(path)}"
        )
    return CheckpointLocation(path, path, "lightning_file", remote=True)
