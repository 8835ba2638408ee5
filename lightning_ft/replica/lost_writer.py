"""The save a lost writer group left unfinished: removed at once by the group that writes next, or named in one line.

One group writes the job's checkpoints (the live group with the lowest id, :mod:`~lightning_ft.replica.checkpoint_owner`).
When it is lost mid-save (a SIGKILL, a lost node) its save never commits: a one-file checkpoint leaves the placeholder
that held its name and the staging folder beside it (``.<name>.lft-new-<token>``), a folder checkpoint its folder
with the in-progress record. Nothing loads them (auto-resume and discovery skip them), but until the next start of a
group cleans up they sit in the folder under the checkpoint's name, and Lightning's ``ModelCheckpoint`` counts the
name as taken.

So the group that takes over writing, at the first quorum without the lost writer, looks at the leftovers of ours in
the checkpoint folders (:func:`settle_lost_writer`). Each names the process that wrote it (its in-progress record:
host and pid). One whose process is gone from this host cannot be finished by anyone: it is removed at once. Any
other (written on another host, or by a process that still runs: a hung writer may still finish its save) is left
for the next start's cleanup and named in one console line, so that nobody mistakes it for a checkpoint. A save in
flight in this process is never touched.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning_ft.checkpoint.internal import UnfinishedSave, discard, unfinished_saves

__all__ = ["settle_lost_writer"]

_log = logging.getLogger(__name__)


def settle_lost_writer(folders: list[Path], *, lost_writer: str) -> tuple[list[Path], list[UnfinishedSave]]:
    """Remove the leftovers under ``folders`` whose writer provably no longer runs; name the others in one warning.

    Call it on rank 0 of the group that has just become the writer because the writer group ``lost_writer`` was lost
    (its first quorum without it), before its first save; not collective. Returns ``(removed, kept)``.
    """
    removed: list[Path] = []
    kept: list[UnfinishedSave] = []
    for folder in folders:
        for leftover in unfinished_saves(Path(folder)):
            if not leftover.writer_gone:
                kept.append(leftover)
                continue
            try:
                discard(leftover.path)
            except OSError as e:  # the next start's cleanup removes it
                _log.warning("lightning-ft: could not remove %s (%s); the next start removes it", leftover.path, e)
                continue
            removed.append(leftover.path)
    if removed:
        _log.info(
            "lightning-ft: removed %s: the unfinished save of replica group %s, lost mid-save",
            ", ".join(p.name for p in removed),
            lost_writer,
        )
    if kept:
        who = sorted({f"pid {k.pid} on host {k.host}" for k in kept})
        _log.warning(
            "lightning-ft: %s: unfinished save(s) of replica group %s (%s), lost mid-save or still writing; not a"
            " checkpoint, never loaded; the next start of a group removes them",
            ", ".join(str(k.path) for k in kept),
            lost_writer,
            ", ".join(who),
        )
    return removed, kept
