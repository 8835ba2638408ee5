"""Retention and the ``last`` link, safe against a save still in flight.

Lightning's ``ModelCheckpoint`` deletes the checkpoint that fell out of its top-k right after asking for the new one,
and asks for ``last*.ckpt`` as a second full save. With asynchronous saves both are races (Lightning #14035): a crash
before the new checkpoint commits would leave nothing to resume from, and a link to the new one would point at a
write in progress. :class:`Retention` defers both to the moment a checkpoint commits. It runs on rank 0 only; the
strategy calls it from the training thread and from the checkpoint writer thread.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from lightning_ft.checkpoint import discovery


class Retention:
    """Deletes checkpoints and repoints ``last`` links, never touching the newest committed or the in-flight one.

    Args:
        in_flight: returns the path of the checkpoint being written, or None.

    Example::

        retention = Retention(in_flight=lambda: checkpointer.in_flight)
        retention.remove(Path("checkpoints/epoch=0-step=100.ckpt"))  # now, or after the next commit
        retention.on_commit(Path("checkpoints/epoch=0-step=200.ckpt"))  # from the commit callback
    """

    def __init__(self, *, in_flight: Callable[[], Path | None]) -> None:
        self._in_flight = in_flight
        self._lock = threading.Lock()
        self._links: set[Path] = set()
        self._pending: list[Path] = []

    def request_last_link(self, link: Path) -> None:
        """Keep ``link`` pointed at the newest committed checkpoint in its folder, from now on."""
        with self._lock:
            self._links.add(link)
        if self._in_flight() is None:
            latest = discovery.latest_committed(link.parent)
            if latest is not None:
                discovery.repoint_last(link.parent, latest.path, name=link.name)

    def on_commit(self, committed: Path) -> None:
        """Call after ``committed``'s marker is durable: repoint its folder's links, run the deferred removals."""
        with self._lock:
            links = [link for link in self._links if link.parent == committed.parent]
            pending, self._pending = self._pending, []
        for link in links:
            discovery.repoint_last(link.parent, committed, name=link.name)
        for path in pending:
            self.remove(path)

    def remove(self, path: Path) -> None:
        """Delete ``path`` now, or after the next commit if it is in flight or the newest committed checkpoint."""
        if path.is_symlink():
            path.unlink()
            return
        in_flight = self._in_flight()
        latest = discovery.latest_committed(path.parent)
        protected = {p.resolve() for p in (in_flight, latest.path if latest else None) if p is not None}
        if path.resolve() in protected:
            with self._lock:
                self._pending.append(path)
            return
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
