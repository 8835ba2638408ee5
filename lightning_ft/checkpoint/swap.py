"""Where a save writes, and how a new checkpoint takes the place of a committed one without ever losing both.

Lightning saves to the same path again whenever ``filename`` has no ``{step}``. A committed checkpoint is only ever
replaced by a committed one: :func:`prepare` has the save written beside it, in a folder of its own named
``.<name>.lft-new-<token>``; once that one is committed, :class:`Swap` moves it in with two renames (the old one to
``.<name>.lft-old-<token>``, the new one to ``<name>``, each followed by an fsync of the folder) and deletes the old one
last. A crash at any instant leaves the old or the new checkpoint committed; :func:`recover_interrupted_swaps`, run on
rank 0 before checkpoints are listed at start, puts the newest committed one back at ``<name>``:

======================================  ==============================================================
state found after a crash               what recovery does
======================================  ==============================================================
new folder without marker (mid-write)   deletes it (it holds our in-progress record); the old one stays
placeholder at ``<name>`` (a new file)  deletes it (no save of this process holds it)
new committed, old still at ``<name>``  moves the old one aside, the new one in, deletes the old one
old moved aside, ``<name>`` missing     moves the newest committed one (the new one) to ``<name>``
new at ``<name>``, old still aside      deletes the old one
======================================  ==============================================================

Only folders of ours (:func:`~lightning_ft.checkpoint.in_progress.is_ours`) are moved or deleted, and nothing whose
target is a save in flight in this process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from lightning_ft.checkpoint.commit import COMMIT_MARKER, uncommit
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.in_progress import (
    discard,
    has_record,
    in_flight_paths,
    is_ours,
    is_placeholder,
    write_record,
)
from lightning_ft.checkpoint.single_file import is_checkpoint_file, read_marker
from lightning_ft.checkpoint.snapshot_storage import fsync_dir

__all__ = ["Swap", "SwapName", "parse_swap_name", "prepare", "recover_interrupted_swaps", "swap_path", "swap_target"]

log = logging.getLogger(__name__)

_SWAP_NAME = re.compile(r"^\.(?P<target>.+)\.lft-(?P<kind>new|old)-(?P<token>[0-9a-f]{16})$")


class SwapName(NamedTuple):
    """The parts of a staging (``new``) or replaced (``old``) folder's name."""

    target: str
    """Name of the checkpoint it belongs to."""
    kind: str
    """``"new"``: a save being written beside ``target``; ``"old"``: the checkpoint it replaced."""
    token: str
    """Identifies one replacement."""


def parse_swap_name(name: str) -> SwapName | None:
    """The parts of ``name`` if it names a staging or replaced folder of ours, else ``None``."""
    match = _SWAP_NAME.match(name)
    return SwapName(match["target"], match["kind"], match["token"]) if match else None


def swap_path(target: Path, kind: str, token: str) -> Path:
    """The staging (``kind="new"``) or replaced (``kind="old"``) folder of checkpoint ``target``."""
    return target.with_name(f".{target.name}.lft-{kind}-{token}")


def swap_target(path: Path) -> Path:
    """The checkpoint path ``path`` belongs to: itself, or for a staging or replaced folder the one it replaces."""
    parsed = parse_swap_name(path.name)
    return path.with_name(parsed.target) if parsed else path


def _committed(path: Path) -> bool:
    # A checkpoint file of ours is committed wherever it stands: only a rename of a durable file puts one anywhere.
    return (path / COMMIT_MARKER).is_file() or is_checkpoint_file(path)


def _rename(source: Path, destination: Path) -> None:
    # os.rename, not os.replace: a folder never lands on a non-empty one (ENOTEMPTY) instead of clobbering it.
    os.rename(source, destination)
    fsync_dir(destination.parent)


def prepare(path: Path, *, step: int | None, run_id: str | None, durable: bool = True) -> Path:
    """Create the folder a save to ``path`` writes into, holding its in-progress record; return it. Rank 0 only.

    ``path`` itself when nothing is there (or an interrupted save of ours, which is deleted first); a staging folder
    beside it when ``path`` holds a committed checkpoint. The record is durable before this returns, so before any data.

    Raises:
        CheckpointError: ``path`` is a link, a file, or a folder lightning-ft cannot prove it wrote; nothing is
            touched.
    """
    if path.is_symlink():
        raise CheckpointError(f"cannot save to {path}: it is a link; lightning-ft does not write through links")
    if path.exists():
        if _committed(path):
            folder = swap_path(path, "new", uuid.uuid4().hex[:16])
        elif is_ours(path):
            discard(path)  # an interrupted save of ours: one save is in flight at a time, so not this one's
            folder = path
        else:
            raise CheckpointError(
                f"cannot save to {path}: it exists and lightning-ft cannot prove it wrote it (no commit marker, no"
                " in-progress record), so it is left alone; move it away or save to another path"
            )
    else:
        folder = path
    return make_staging(folder, target=path, step=step, run_id=run_id, durable=durable)


def make_staging(folder: Path, *, target: Path, step: int | None, run_id: str | None, durable: bool = True) -> Path:
    """Create ``folder`` holding the in-progress record of a save to ``target``, durable (the record and the folder's
    entry fsynced) before this returns, so before any data is written; return it. ``durable=False``: the caller
    makes it durable before any data (:func:`~lightning_ft.checkpoint.in_progress.make_durable`)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir()
    write_record(folder, target=target, step=step, run_id=run_id, durable=durable)
    if durable:
        fsync_dir(folder.parent)
    return folder


class Swap:
    """Moves the committed checkpoint ``staged`` into the place of the committed checkpoint ``target``. Rank 0 only.

    :meth:`swap` then :meth:`finish` replace it; :meth:`undo`, called instead of :meth:`finish`, puts the old one back
    and deletes the new one (a save that failed after its marker).

    Example::

        swap = Swap(staged, target)
        swap.swap()  # target is the new checkpoint; the old one waits beside it
        swap.finish()  # the old one is deleted
    """

    def __init__(self, staged: Path, target: Path) -> None:
        parsed = parse_swap_name(staged.name)
        assert parsed is not None and parsed.kind == "new", staged
        self.staged = staged
        self.target = target
        self.old = swap_path(target, "old", parsed.token)
        self._old_moved = False
        self._new_moved = False

    def swap(self) -> None:
        """Move the old checkpoint aside and the new one in, each durably."""
        _rename(self.target, self.old)
        self._old_moved = True
        _rename(self.staged, self.target)
        self._new_moved = True

    def finish(self) -> None:
        """Delete the old checkpoint."""
        discard(self.old)

    def undo(self) -> None:
        """Put the old checkpoint back at ``target`` and delete the new one, whichever steps had run."""
        if self._new_moved:
            # Uncommitted before it moves, so that the new one never stands at `target` or aside as committed.
            write_record(self.target, target=self.target, step=None, run_id=None)
            uncommit(self.target)
            _rename(self.target, self.staged)
            self._new_moved = False
        discard(self.staged)
        if self._old_moved:
            _rename(self.old, self.target)
            self._old_moved = False


def _commit_time(path: Path) -> float:
    if path.is_file():
        value = (read_marker(path) or {}).get("time")
        return float(value) if isinstance(value, (int, float)) else 0.0
    marker = path / COMMIT_MARKER
    try:
        value = json.loads(marker.read_bytes()).get("time")
        return float(value) if isinstance(value, (int, float)) else marker.stat().st_mtime
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        return 0.0


def _newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: (_commit_time(p), p.name)) if paths else None


def _settle(target: Path, members: list[tuple[str, Path]]) -> bool:
    """Leave the newest committed checkpoint of one replacement at ``target``; returns whether anything changed."""
    changed = False
    for _, folder in members:
        if not _committed(folder) and has_record(folder):
            discard(folder)  # a staged save that never committed, or an old one half deleted
            changed = True
    news = [f for kind, f in members if kind == "new" and _committed(f)]
    olds = [f for kind, f in members if kind == "old" and _committed(f)]
    current: Path | None = None
    if target.exists() or target.is_symlink():
        if _committed(target) and not target.is_symlink():
            current = target
        elif is_ours(target):
            discard(target)  # a new checkpoint uncommitted by an undo that did not finish
            changed = True
        else:
            log.warning("%s is not a lightning-ft checkpoint; the replacement folders beside it are left alone", target)
            return changed
    winner = _newest(news) or current or _newest(olds)
    if winner is None:
        return changed
    aside: list[Path] = [f for f in (*news, *olds) if f != winner]
    if winner != target:
        if current is not None:
            moved = swap_path(target, "old", uuid.uuid4().hex[:16])
            _rename(target, moved)
            aside.append(moved)
        _rename(winner, target)
        changed = True
    for folder in aside:
        discard(folder)
        changed = True
    return changed


def recover_interrupted_swaps(dirpath: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Finish or undo the replacements a crash interrupted under ``dirpath``; returns the checkpoint paths settled.

    Rank 0 only, at start, before checkpoints are listed (auto-resume and the cleanup at train start call it).
    Afterwards every checkpoint path whose replacement was interrupted holds the newest committed checkpoint written
    to it, and no staging or replaced folder of ours is left. Skips the targets in ``keep`` and those of saves in
    flight in this process.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    skipped = {Path(os.path.abspath(p)) for p in keep} | in_flight_paths()
    groups: dict[str, list[tuple[str, Path]]] = {}
    for child in dirpath.iterdir():
        parsed = parse_swap_name(child.name)
        if parsed is not None and not child.is_symlink() and (child.is_dir() or is_checkpoint_file(child)):
            groups.setdefault(parsed.target, []).append((parsed.kind, child))
    settled = []
    for child in sorted(dirpath.iterdir()):
        # The placeholder of a save that was killed before its commit replaced it: ours, and no checkpoint.
        if parse_swap_name(child.name) is None and is_placeholder(child) and child.name not in groups:
            if Path(os.path.abspath(child)) not in skipped:
                discard(child)
                settled.append(child)
                log.warning("lightning-ft: removed %s, the placeholder of a save that never committed", child)
    for name, members in sorted(groups.items()):
        target = dirpath / name
        if Path(os.path.abspath(target)) in skipped:
            continue
        if _settle(target, members):
            settled.append(target)
            log.warning("lightning-ft: settled a replacement of %s that was interrupted (a crash, a kill)", target)
    return settled
