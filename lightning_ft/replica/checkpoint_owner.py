"""Who writes the job's checkpoints in replica mode, and whether a starting group reads one.

The groups hold the same committed state, so one group writes each checkpoint to the user's ``ModelCheckpoint``
path and the others skip the write (and the retention's removals): the *writer* is the live group with the lowest
replica id in the step's quorum (numeric ids by value, then the others by name), which every group computes from the
same quorum, so they agree without a message. When the writer dies mid-save its save never commits (the commit is
atomic); the next save is written by the new lowest id.

A group that starts while a live quorum trains (a replacement) does not read the disk: it heals from a live group at
its first step (docs/replica-groups.md). Whether one exists is asked of the lighthouse before the checkpoint is chosen
(:func:`live_peers`); a live group counts only when its committed step is at least the newest checkpoint's on disk,
so that skipping the disk can never rewind. Every group of a whole-job restart finds none and resumes from the
newest committed checkpoint; the groups then agree at the first quorum (a group behind the newest heals).
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_ft import _compat

__all__ = ["checkpoint_writer", "live_peers"]


def checkpoint_writer(replica_ids: Iterable[str]) -> str | None:
    """The replica id that writes checkpoints among ``replica_ids`` (a quorum's members); ``None`` for none."""
    ids = list(replica_ids)
    if not ids:
        return None
    return min(ids, key=lambda rid: (0, int(rid), rid) if rid.isdigit() else (1, 0, rid))


def live_peers(lighthouse: str, replica_id: str, *, newest_on_disk: int | None, timeout_s: float) -> dict[str, int]:
    """The other groups of the lighthouse's last quorum that still heartbeat and whose committed step is at least
    ``newest_on_disk`` (the newest checkpoint's step; ``None``: no checkpoint), as ``{replica id: step}``. Empty when
    the lighthouse cannot be read (the group then reads its checkpoint, as without replica groups)."""
    try:
        members = _compat.lighthouse_live_members(lighthouse, timeout_s=timeout_s) or {}
    except _compat.LighthouseStatusError:
        members = {}
    floor = newest_on_disk or 0
    return {rid: step for rid, step in members.items() if rid != replica_id and step >= floor}
