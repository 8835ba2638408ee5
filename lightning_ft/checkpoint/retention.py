"""Retention, and where a ``last`` save goes, safe against a save still in flight.

Lightning's ``ModelCheckpoint`` deletes the checkpoint that fell out of its top-k right after asking for the new one.
With asynchronous saves that is a race (Lightning #14035): a crash before the new checkpoint commits would leave
nothing to resume from. :class:`Retention` defers such a deletion to the moment a checkpoint commits: every deletion
asked for while a save is in flight waits for that save's commit, as under ``DDPStrategy``, whose synchronous save has
written the replacement before Lightning deletes. Protecting only the newest committed checkpoint is not enough: with
``save_last=True`` the newest is ``last``, and a crash before the new top-k checkpoint commits would leave a resume from
``last`` whose ``ModelCheckpoint`` state names a best checkpoint that was deleted. It runs on rank 0 only; the strategy
calls it from the training thread and from the checkpoint writer thread.

``last`` is what Lightning makes of it: with ``save_last=True`` a checkpoint of its own at the path Lightning asks for
(a write to one path never changes another; the strategy writes it from the capture of the save just before when the
state is the same, :meth:`~lightning_ft.checkpoint.AsyncCheckpointer.save_again`), with ``save_last="link"`` the link
Lightning itself makes. On an object store, which has no links, a ``last`` save of a state already committed or being
written in that folder writes nothing (``last`` is the newest marker found by listing).

Only what lightning-ft can prove it wrote is deleted (:func:`~lightning_ft.checkpoint.in_progress.is_ours`): a file or
folder Lightning asks to remove that holds neither our commit marker nor our in-progress record (a ``.ckpt`` file of an
earlier run under another strategy, say) is left alone, with a warning; a link is removed (it holds no data). A failed
deletion is a warning, never an error: a failure of the commit callback undoes the commit, which must never follow a
deletion.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from lightning_ft.checkpoint import discovery
from lightning_ft.checkpoint.in_progress import discard, in_flight_paths, is_ours
from lightning_ft.checkpoint.storage.object_store import ObjectStore, as_url, is_remote

log = logging.getLogger(__name__)


class Retention:
    """Deletes checkpoints, never touching the newest committed, the in-flight one or a checkpoint a link points at.

    Args:
        in_flight: returns the path of the checkpoint being written, or None.
        in_flight_step: returns the global step of the checkpoint being written, or None.

    Example::

        retention = Retention(in_flight=lambda: checkpointer.in_flight)
        retention.remove(Path("checkpoints/epoch=0-step=100.ckpt"))  # now, or after the next commit
        retention.on_commit(Path("checkpoints/epoch=0-step=200.ckpt"))  # from the commit callback
    """

    def __init__(
        self, *, in_flight: Callable[[], Path | None], in_flight_step: Callable[[], int | None] = lambda: None
    ) -> None:
        self._in_flight = in_flight
        self._in_flight_step = in_flight_step
        self._lock = threading.Lock()
        self._pending_removals: list[Path] = []
        self._warned: set[Path] = set()

    def _warn_once(self, path: Path, message: str) -> None:
        if path in self._warned:
            return
        self._warned.add(path)
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(message)

    def plan_last(self, link: Path, step: int | None, *, same_state: Path | None = None) -> Path | None:
        """Decide where the ``last`` save at ``step`` to ``link`` is written: ``link`` itself (a checkpoint of its own),
        or ``None`` when nothing is to be written.

        ``None`` for a local path that holds a file or folder lightning-ft cannot prove it wrote (a warning says so,
        once; it is left as it is), and on an object store when ``same_state``, a checkpoint the caller has proven to
        hold exactly this state, is committed or being written in the same folder.
        """
        if is_remote(link):
            return self._plan_remote_last(link, step, same_state)
        if link.exists() and not link.is_symlink() and not is_ours(link):
            self._warn_once(
                link,
                f"{link} exists and is not a checkpoint lightning-ft wrote (a file or folder another run wrote); it is"
                " left as it is, and this run keeps no `last` checkpoint there.",
            )
            return None
        return link

    def _plan_remote_last(self, link: Path, step: int | None, same_state: Path | None) -> Path | None:
        # Object stores have no links: `last` is the newest marker found by listing. The same state committed or being
        # written in that folder needs no second copy; another one is written at the path Lightning asked for.
        if same_state is not None and same_state.parent == link.parent:
            in_flight = self._in_flight()
            if in_flight is not None and in_flight == same_state and self._in_flight_step() == step:
                return None
            if any(info.path == same_state for info in discovery.list_committed(link.parent)):
                return None
        return link

    def on_commit(self, committed: Path) -> None:
        """Call after ``committed``'s marker is durable: run the removals that waited for a commit. Never raises."""
        with self._lock:
            pending, self._pending_removals = self._pending_removals, []
        for path in pending:
            self.remove(path, committed=committed)

    def remove(self, path: Path, *, committed: Path | None = None) -> None:
        """Delete ``path`` now, or after the next commit if a save is in flight (the replacement Lightning asked for
        just before), ``path`` is the newest committed checkpoint of its folder, or what a ``last`` link points at. A
        link is unlinked; a file or folder that is not ours is left alone (a warning says so, once). ``committed``:
        the save whose commit runs this removal (no longer in flight). Never raises for a deletion that fails: it
        warns."""
        if is_remote(path):
            self._remove_remote(path)
            return
        if path.is_symlink():
            path.unlink()
            return
        in_flight = self._in_flight()
        if in_flight is not None and committed is not None and in_flight == committed:
            in_flight = None  # its commit callback runs this: the save is durable, only its future is not done yet
        if in_flight is not None or Path(os.path.abspath(path)) in in_flight_paths():
            with self._lock:
                self._pending_removals.append(path)
            return
        if not path.exists():
            return
        if not is_ours(path):
            self._warn_once(
                path,
                f"{path} is not a checkpoint lightning-ft wrote (no commit marker, no in-progress record); it is left"
                " as it is, although Lightning asked to remove it.",
            )
            return
        latest = discovery.latest_committed(path.parent)
        protected = {p.resolve() for p in (in_flight, latest.path if latest else None) if p is not None}
        protected |= {c.resolve() for c in path.parent.iterdir() if c.is_symlink()} if path.parent.is_dir() else set()
        if path.resolve() in protected:
            with self._lock:
                self._pending_removals.append(path)
            return
        try:
            discard(path)
        except (OSError, ValueError) as e:
            log.warning("lightning-ft: could not delete checkpoint %s (%s); it is left as it is", path, e)

    def _remove_remote(self, path: Path) -> None:
        store = ObjectStore()
        in_flight = self._in_flight()
        latest = discovery.latest_committed(path.parent)
        if path in {in_flight, latest.path if latest else None}:
            with self._lock:
                self._pending_removals.append(path)
            return
        if not store.is_ours(path):
            if store.exists(path):
                self._warn_once(path, f"{as_url(path)} is not a checkpoint lightning-ft wrote; it is left as it is.")
            return
        try:
            store.remove(path)
        except (OSError, ValueError) as e:
            log.warning("lightning-ft: could not delete checkpoint %s (%s); it is left as it is", as_url(path), e)
