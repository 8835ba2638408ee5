"""Asynchronous saves to object-store URLs as well as to folders: the writer ``ElasticFT3D`` uses.

:class:`ObjectStoreCheckpointer` is an :class:`~lightning_ft.checkpoint.AsyncCheckpointer` (same capture, background
thread, exchanges and coverage check) whose save to an fsspec URL (``s3://``, ``gs://``, ``memory://``) goes through
:class:`~lightning_ft.checkpoint.storage.ObjectStore`'s commit protocol instead of folders, renames and links: the data
goes into a generation prefix of its own, rank 0 PUTs the metadata and then the marker object, and a checkpoint the save
replaced is deleted only after the new marker is in place. A save to a local path is exactly the parent's.

:class:`RoutedStorage` is the storage seam under it: object-store URLs to the :class:`ObjectStore`, everything else to
the on-disk format's storage. Wrappers of the seam (the fault injector's) wrap a :class:`RoutedStorage`, so their
faults reach object-store saves too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.async_checkpointer import AsyncCheckpointer
from lightning_ft.checkpoint.storage.object_store import ObjectStore, as_url, is_remote

__all__ = ["ObjectStoreCheckpointer", "RoutedStorage"]

log = logging.getLogger(__name__)


class RoutedStorage:
    """The storage seam for both kinds of path: ``objects`` for object-store URLs, ``local`` for the rest.

    Example::

        storage = RoutedStorage(DcpStorage(), ObjectStore())
    """

    def __init__(self, local: Any, objects: ObjectStore | None = None) -> None:
        self.local = local
        self.objects = objects or ObjectStore()

    def write(
        self,
        path: str | os.PathLike,
        entries: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
        **kw: Any,
    ) -> None:
        """As the seam's ``write``; collective exactly when the storage it routes to is."""
        if is_remote(path):
            self.objects.write(as_url(path), entries, group=group)
        else:
            self.local.write(path, entries, group=group, **kw)

    def reader(self, path: str | os.PathLike) -> Any:
        return self.objects.reader(as_url(path)) if is_remote(path) else self.local.reader(path)


class ObjectStoreCheckpointer(AsyncCheckpointer):
    """An :class:`~lightning_ft.checkpoint.AsyncCheckpointer` that also saves to object-store URLs.

    Arguments as for the parent; ``storage`` should route URLs to an :class:`ObjectStore` (a :class:`RoutedStorage`,
    or a wrapper of one), and ``objects`` is the store that commits them (default: the routed storage's, else a new
    one). Paths may be given as URLs or as :class:`pathlib.Path` objects made from URLs (which fold ``s3://`` into
    ``s3:/``). Calling contract, consistency and error surfacing are the parent's; what differs is the commit:

    - ``prepare``: rank 0 PUTs the in-progress record into a new generation prefix; a URL that holds objects
      lightning-ft cannot prove it wrote fails the save;
    - ``commit``: rank 0 checks the coverage of the index, PUTs the metadata and then the marker (which names the
      generation; a committed checkpoint at the same URL stays committed until this PUT), runs ``on_commit``, and only
      then deletes the generation the marker replaced. If ``on_commit`` raises, the previous marker is put back (or the
      new one removed) and the new generation deleted: a save reported as failed is never committed.

    Example::

        writer = ObjectStoreCheckpointer(storage=RoutedStorage(SnapshotStorage()))
        writer.save("s3://bucket/ckpts/step=100", {"model": model.state_dict()}, metadata={"step": 100})
        writer.close()
    """

    def __init__(self, *, objects: ObjectStore | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        routed = self._storage
        while not isinstance(routed, RoutedStorage) and hasattr(routed, "inner"):
            routed = routed.inner  # a wrapper of the seam, such as the fault injector's
        self._objects = objects or (routed.objects if isinstance(routed, RoutedStorage) else ObjectStore())

    def _prepare(self, job: Any, *, durable: bool = True) -> Path:
        if not is_remote(job.path):
            return super()._prepare(job, durable=durable)
        return Path(self._objects.prepare(as_url(job.path), step=job.metadata["step"], run_id=job.metadata["run_id"]))

    def _discard_failed(self, job: Any) -> None:
        if not is_remote(job.path):
            super()._discard_failed(job)
            return
        try:
            self._objects.discard(as_url(job.folder))
        except Exception as e:  # noqa: BLE001 - a leftover of ours is removed by the next cleanup instead
            log.warning("lightning-ft: could not delete the objects of a failed save (%s): %s", job.folder, e)

    def _commit(self, job: Any, gathered: list[Any]) -> None:
        if not is_remote(job.path):
            super()._commit(job, gathered)
            return
        document, size_bytes = self._document(job, gathered, as_url(job.path))
        commit = self._objects.commit(
            as_url(job.folder), document, step=job.metadata["step"], full_state=job.metadata["full_state"]
        )
        job.committed = True
        try:
            if self._on_commit is not None:
                self._on_commit(self._commit_info(job, size_bytes))
        except BaseException:
            try:
                commit.undo()
            except Exception as undo_error:  # noqa: BLE001 - the first error is the one raised
                log.warning("lightning-ft: undoing the failed save %s failed too (%s)", as_url(job.path), undo_error)
            job.committed = False
            raise
        try:
            commit.finish()
        except Exception as e:  # noqa: BLE001 - the committed checkpoint stands; the next cleanup removes leftovers
            log.warning("lightning-ft: could not delete what %s replaced: %s", as_url(job.path), e)
