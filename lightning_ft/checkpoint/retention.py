"""Retention and the ``last`` link, safe against a save still in flight.

Lightning's ``ModelCheckpoint`` deletes the checkpoint that fell out of its top-k right after asking for the new one,
and asks for ``last*.ckpt`` as a second save of the same state. With asynchronous saves both are races (Lightning
#14035): a crash before the new checkpoint commits would leave nothing to resume from, and a link to the new one would
point at a write in progress. :class:`Retention` defers both to the moment a checkpoint commits. It runs on rank 0
only; the strategy calls it from the training thread and from the checkpoint writer thread.

``last`` holds the newest state Lightning asked to save as last. When the caller has proven that a checkpoint committed
or being written in the same folder holds exactly that state (the save just before, of the same step, with the same
bytes), ``last`` becomes an atomically repointed link to it (no second copy). Otherwise the state is written to a
folder of lightning-ft's own beside the link, ``<link name>.step=<N>.lft``, and the link follows it when it commits; the
superseded one is removed after that.

Only what lightning-ft can prove it wrote is deleted (:func:`~lightning_ft.checkpoint.in_progress.is_ours`): a file or
folder Lightning asks to remove that holds neither our commit marker nor our in-progress record (a ``.ckpt`` file of an
earlier run under another strategy, say) is left alone, with a warning; a link is removed (it holds no data). After a
commit, the links are repointed first and checkpoints deleted last, and a failed deletion is a warning, never an error:
a failure of the commit callback undoes the commit, which must never follow a deletion.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

from lightning_ft.checkpoint import discovery
from lightning_ft.checkpoint.in_progress import discard, is_ours
from lightning_ft.checkpoint.storage.object_store import ObjectStore, as_url, is_remote

log = logging.getLogger(__name__)

_OWNED_LAST = re.compile(r"^(?P<link>.+)\.step=(?P<step>-?\d+|none)\.lft$")


def last_data_path(link: Path, step: int | None) -> Path:
    """Where the state of a ``last`` save at ``step`` is written when no checkpoint of that step exists."""
    return link.with_name(f"{link.name}.step={step if step is not None else 'none'}.lft")


def is_last_data(path: Path) -> bool:
    """Whether ``path`` is a folder lightning-ft created to hold a ``last`` state (see :func:`last_data_path`)."""
    return bool(_OWNED_LAST.match(path.name))


class Retention:
    """Deletes checkpoints and repoints ``last`` links, never touching the newest committed, the in-flight one or a
    checkpoint a ``last`` link points at.

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
        self._pending_links: dict[Path, Path] = {}  # link -> the checkpoint it points at once that one commits
        self._pending_removals: list[Path] = []
        self._warned: set[Path] = set()
        self.single_file = False
        """Whether checkpoints are single files (``checkpoint_format="file"``): ``last`` is then a file of its own, a
        hard link to the committed file of the same step (no second copy, and ``os.path.isfile`` holds), or the state
        written at the ``last`` path itself."""

    def _warn_once(self, path: Path, message: str) -> None:
        if path in self._warned:
            return
        self._warned.add(path)
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(message)

    def plan_last(self, link: Path, step: int | None, *, same_state: Path | None = None) -> Path | None:
        """Decide how the ``last`` save at ``step`` to ``link`` is kept.

        ``same_state``: a checkpoint the caller has proven to hold exactly the state of this save (``None``: none).
        Returns None when no write is needed: ``same_state`` is in the link's folder and committed (the link is
        repointed now) or being written (the link follows its commit). Otherwise returns the folder the caller must
        write the state to; the link follows it when it commits.
        """
        if is_remote(link):
            return self._plan_remote_last(link, step, same_state)
        # Single files: `last` is a hard link to the committed file of the same state, or that state written at the
        # `last` path itself (a rename onto the previous `last`, which is ours, or a link). Folders: `last` is a link;
        # a checkpoint file of ours there is the `last` of a run that had one process until now, replaced by a link.
        if link.exists() and not link.is_symlink() and not (is_ours(link) if self.single_file else _our_file(link)):
            self._warn_not_a_link(link)
            return None
        if same_state is not None and same_state.parent == link.parent:
            in_flight = self._in_flight()
            if in_flight is not None and in_flight == same_state and self._in_flight_step() == step:
                self._follow(link, in_flight)
                return None
            if (same_state.is_file() or not self.single_file) and discovery.is_committed(same_state):
                self._follow(link, None)
                self._repoint(link, same_state)
                return None
        if self.single_file:
            self._follow(link, None)
            return link
        target = last_data_path(link, step)
        self._follow(link, target)
        return target

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

    def _follow(self, link: Path, target: Path | None) -> None:
        """Make ``link`` wait for ``target`` (None: for nothing); a state of ours it waited for is superseded."""
        with self._lock:
            superseded = self._pending_links.pop(link, None)
            if target is not None:
                self._pending_links[link] = target
        if superseded is not None and superseded != target and is_last_data(superseded):
            self.remove(superseded)  # still being written: removed after a later commit

    def _warn_not_a_link(self, link: Path) -> None:
        self._warn_once(
            link,
            f"{link} exists and is not a lightning-ft link (a file or folder another run wrote); it is left as it is,"
            " and this run keeps no `last` link there.",
        )

    def on_commit(self, committed: Path) -> None:
        """Call after ``committed``'s marker is durable: repoint the links waiting for it, then run the removals that
        waited for a commit. Raises only if a link cannot be repointed, and then before deleting anything."""
        with self._lock:
            links = [link for link, target in self._pending_links.items() if target == committed]
            for link in links:
                del self._pending_links[link]
        superseded = [previous for link in links if (previous := self._repoint(link, committed, remove=False))]
        with self._lock:
            pending, self._pending_removals = self._pending_removals, []
        for path in (*superseded, *pending):
            self.remove(path)

    def _repoint(self, link: Path, target: Path, *, remove: bool = True) -> Path | None:
        """Point ``link`` at ``target``; the superseded ``last`` state of ours it pointed at is removed (``remove``)
        or returned."""
        if link.exists() and not link.is_symlink() and not _our_file(link):
            self._warn_not_a_link(link)  # appeared since the save was planned: never replaced
            return None
        previous = link.resolve() if link.is_symlink() else None
        if target.is_file():
            discovery.relink_last_file(link.parent, target, name=link.name)
        else:
            discovery.repoint_last(link.parent, target, name=link.name)
        if previous is not None and previous != target.resolve() and is_last_data(previous):
            if not remove:
                return previous
            self.remove(previous)  # a superseded state of our own
        return None

    def _linked(self) -> set[Path]:
        with self._lock:
            pending = set(self._pending_links.values())
        return {p.resolve() for p in pending}

    def remove(self, path: Path) -> None:
        """Delete ``path`` now, or after the next commit if it is in flight, the newest committed checkpoint of its
        folder, or what a ``last`` link points at. A link is unlinked; a file or folder that is not ours is left alone
        (a warning says so, once). Never raises for a deletion that fails: it warns."""
        if is_remote(path):
            self._remove_remote(path)
            return
        if path.is_symlink():
            path.unlink()
            return
        in_flight = self._in_flight()
        if in_flight is not None and path.resolve() == in_flight.resolve():
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
        protected |= self._linked()
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


def _our_file(path: Path) -> bool:
    """Whether ``path`` is a checkpoint file lightning-ft wrote (a ``last`` kept as a file of its own)."""
    return path.is_file() and not path.is_symlink() and is_ours(path)
