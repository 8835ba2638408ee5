"""Who writes the job's checkpoints in replica mode, and whether a starting group reads one.

The groups hold the same committed state, so one group writes each checkpoint to the user's ``ModelCheckpoint``
path and the others skip the write (and the retention's removals): the *writer* is the live group with the lowest
replica id in the step's quorum (numeric ids by value, then the others by name), which every group computes from the
same quorum, so they agree without a message. When the writer dies mid-save its save never commits (the commit is
atomic); the next save is written by the new lowest id.

A group that does not write names its saves as the writer does (:class:`WriterView`): Lightning's ``ModelCheckpoint``
checks whether a file name is taken before each save (its version counter, ``-v1``), and the writer's file of the
same save may already be there; the non-writing group answers that check from the folder as it was at the step's
quorum, when no group can have started a save of the step, plus its own (skipped) saves since, which is what the
writer saw. So ``best_model_path``, ``last_model_path`` and the top-k names are the same in every group.

A group that starts while a live quorum trains (a replacement) does not read the disk: it heals from a live group at
its first step (docs/replica-groups.md). Whether one exists is asked of the lighthouse before the checkpoint is chosen
(:func:`live_peers`); a live group counts only when its committed step is at least the newest checkpoint's on disk
(and the group's own memory-tier copy's: auto-resume passes the newer of the two), so that skipping them can never
rewind. Every group of a whole-job restart finds none and resumes from the
newest committed checkpoint; the groups then agree at the first quorum (a group behind the newest heals).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning_ft import _compat

__all__ = ["WriterView", "checkpoint_writer", "live_peers", "writing_process"]


def checkpoint_writer(replica_ids: Iterable[str]) -> str | None:
    """The replica id that writes checkpoints among ``replica_ids`` (a quorum's members); ``None`` for none."""
    ids = list(replica_ids)
    if not ids:
        return None
    return min(ids, key=lambda rid: (0, int(rid), rid) if rid.isdigit() else (1, 0, rid))


def writing_process(full_ids: Iterable[str]) -> str | None:
    """Of a quorum's participants (torchft's full ids, ``"<replica id>:<uuid>"``), the one that writes: the lowest
    replica id (:func:`checkpoint_writer`) and, should two processes have that id (replica/duplicate_id.py), the lower
    full id, so that they never both write. ``None`` for none."""
    ids = list(full_ids)
    writer = checkpoint_writer(rid.split(":")[0] for rid in ids)
    return min((rid for rid in ids if rid.split(":")[0] == writer), default=None)


def live_peers(lighthouse: str, replica_id: str, *, newest_on_disk: int | None, timeout_s: float) -> dict[str, int]:
    """The other groups of the lighthouse's last quorum that still heartbeat and whose committed step is at least
    ``newest_on_disk`` (the newest checkpoint's step; ``None``: no checkpoint), as ``{replica id: step}``. Empty when
    the lighthouse cannot be reached (the group then reads its checkpoint, as without replica groups; its Manager
    cannot join a quorum either).

    Raises:
        LighthouseStatusError: the lighthouse answered with a status page lightning-ft cannot read (a torchft other
            than 0.2.0): reading the checkpoint beside groups that may be live could remove the writer's save in flight
            (leftovers are cleaned at train start), so the group stops and says why instead.
    """
    members = _compat.lighthouse_live_members(lighthouse, timeout_s=timeout_s) or {}
    floor = newest_on_disk or 0
    return {rid: step for rid, step in members.items() if rid != replica_id and step >= floor}


class WriterView:
    """The checkpoint folders as the writing group sees them when it names a save, kept by a group that does not
    write (see the module docstring): :meth:`refresh` at each step's quorum lists the folders (a save of an earlier
    step holds its path from its save call on, and every group's save of a step starts after the step's quorum),
    :meth:`saved` adds the path of each save this group skipped since, and :meth:`exists` answers from that.

    Only local folders are listed; a path elsewhere (an object store) is checked on the storage as Lightning does.
    Thread use: the training thread only.
    """

    def __init__(self) -> None:
        self._folders: set[str] = set()
        self._names: set[str] | None = None
        self._patches: list[_compat.Patch] = []

    def refresh(self, folders: Iterable[Path]) -> None:
        """List ``folders`` now (a non-writing group, at the step's quorum)."""
        self._folders, self._names = set(), set()
        for folder in folders:
            key = _key(folder)
            self._folders.add(key)
            try:
                self._names.update(os.path.join(key, name) for name in os.listdir(folder))
            except OSError:
                pass  # not created yet: nothing in it is taken

    def clear(self) -> None:
        """This group writes: names are checked on the storage, as Lightning does."""
        self._folders, self._names = set(), None

    def saved(self, path: Any) -> None:
        """A save this group skipped (the writer writes it): its path is taken from now on."""
        if self._names is not None:
            self._names.add(_key(path))

    def exists(self, path: Any) -> bool | None:
        """Whether the writer sees ``path`` taken; ``None``: ask the storage (this group writes, or not a listed
        folder)."""
        if self._names is None:
            return None
        key = _key(path)
        if os.path.dirname(key) not in self._folders:
            return None
        return key in self._names

    def install(self, callbacks: Iterable[Any]) -> None:
        """Answer each ``ModelCheckpoint``'s ``file_exists`` (its version counter's check; Lightning 2.6.x: global rank
        0 checks, the group agrees through ``reduce_boolean_decision``) from this view where it has one."""
        for callback in callbacks:
            if callable(getattr(callback, "file_exists", None)):
                self._patches.append(
                    _compat.Patch(
                        callback,
                        "file_exists",
                        _file_exists(self, callback.file_exists),
                        name="replica checkpoint names",
                    ).install()
                )

    def uninstall(self) -> None:
        while self._patches:
            self._patches.pop().undo()


def _file_exists(view: WriterView, original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def file_exists(filepath: Any, trainer: Any) -> bool:
        seen = view.exists(filepath) if trainer.is_global_zero else False
        if seen is None:
            return original(filepath, trainer)
        return bool(trainer.strategy.reduce_boolean_decision(seen, all=False))

    return file_exists


def _key(path: Any) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(path)))
