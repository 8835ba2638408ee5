"""Checkpoints in object storage (S3, GCS, Azure, ...) through fsspec, committed without rename or link.

Object stores have no rename, no link and no fsync, but a PUT is atomic: an object is seen whole or not at all. So the
commit protocol needs no temporary names:

- every rank writes its entries as one object ``<ckpt>/data/<rank>`` (entries back to back) and their byte ranges as
  ``<ckpt>/data/<rank>.json``, written after the data object (:meth:`ObjectStore.write`);
- rank 0 writes the metadata object, then the marker object, last (:meth:`ObjectStore.commit`);
- a checkpoint counts when its marker object exists; the newest (``last``) is found by listing the markers
  (:meth:`ObjectStore.list_committed`), never through a link;
- a checkpoint is removed marker first (:meth:`ObjectStore.remove`), and a prefix without a marker is removed by
  :meth:`ObjectStore.cleanup_uncommitted` only when it holds lightning-ft's data objects (something it can prove it wrote).

:class:`ObjectStore` has the storage seam's ``write``/``reader`` interface plus the commit and discovery functions that
the filesystem code does with rename, fsync and links. Paths are fsspec URLs (``s3://bucket/ckpts/step=100``,
``memory://ckpts/step=100``).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from lightning_ft.checkpoint.commit import COMMIT_MARKER, FORMAT_VERSION, METADATA_FILE

__all__ = ["ObjectCheckpointInfo", "ObjectReader", "ObjectStore"]


@dataclass(frozen=True)
class ObjectCheckpointInfo:
    """A committed checkpoint found by listing marker objects."""

    path: str
    """The checkpoint's URL (no trailing slash)."""
    step: int | None
    time: float
    """The commit time recorded in its marker (object stores' modification times are not comparable across stores)."""


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


class ObjectStore:
    """Writes, reads, commits, lists and removes checkpoints under fsspec URLs.

    Args:
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, endpoint, ...).

    Example::

        store = ObjectStore()
        store.write("s3://bucket/ckpts/step=100", entries, group=None)  # every rank
        store.commit("s3://bucket/ckpts/step=100", document, step=100)  # rank 0, after every rank wrote
        store.list_committed("s3://bucket/ckpts")[-1].path  # the newest: what `last` means here
    """

    name = "object_store"

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self._options = dict(storage_options or {})

    def _fs(self, url: str) -> tuple[Any, str]:
        fs, path = fsspec.core.url_to_fs(url, **self._options)
        return fs, path

    # -- the seam ------------------------------------------------------------------------------------------------------

    def write(self, path: str, entries: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None) -> None:
        """Write this rank's ``entries`` (1-D ``uint8`` CPU tensors) as one data object and its index.

        Every rank calls it; it does no communication (each rank writes objects of its own). The index object is
        written after the data object, so an index always describes a complete data object.
        """
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        fs, root = self._fs(str(path))
        index, start = {}, 0
        with fs.open(_join(root, "data", str(rank)), "wb") as f:
            for name, data in entries.items():
                buffer = memoryview(data.contiguous().numpy())
                f.write(buffer)
                index[name] = [start, len(buffer)]
                start += len(buffer)
        fs.pipe_file(_join(root, "data", f"{rank}.json"), json.dumps(index).encode())

    def reader(self, path: str) -> ObjectReader:
        return ObjectReader(self, str(path))

    # -- commit and discovery ------------------------------------------------------------------------------------------

    def commit(self, path: str, document: dict[str, Any], *, step: int | None) -> None:
        """Rank 0, after every rank's :meth:`write` returned: the metadata object, then the marker object, last."""
        fs, root = self._fs(str(path))
        data = json.dumps(document, allow_nan=False).encode()
        fs.pipe_file(_join(root, METADATA_FILE), data)
        marker = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "metadata_crc32": zlib.crc32(data),
        }
        fs.pipe_file(_join(root, COMMIT_MARKER), json.dumps(marker).encode())

    def is_committed(self, path: str) -> bool:
        fs, root = self._fs(str(path))
        return fs.exists(_join(root, COMMIT_MARKER))

    def read_document(self, path: str) -> dict[str, Any]:
        """The metadata document of committed checkpoint ``path``, checked against its marker's checksum."""
        from lightning_ft.checkpoint.errors import CorruptCheckpointError, UncommittedCheckpointError

        fs, root = self._fs(str(path))
        try:
            marker = json.loads(fs.cat_file(_join(root, COMMIT_MARKER)))
        except FileNotFoundError:
            raise UncommittedCheckpointError(f"checkpoint {path} has no commit marker {COMMIT_MARKER}") from None
        data = fs.cat_file(_join(root, METADATA_FILE))
        if marker.get("metadata_crc32") not in (None, zlib.crc32(data)):
            raise CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} does not match its marker's checksum")
        return json.loads(data)

    def list_committed(self, dirpath: str) -> list[ObjectCheckpointInfo]:
        """Committed checkpoints directly under ``dirpath``, by step ascending (``None`` first), then commit time.

        Found by listing marker objects: the last one is the newest checkpoint, the object-store ``last``.
        """
        fs, root = self._fs(str(dirpath))
        found = []
        for marker in fs.glob(_join(root, "*", COMMIT_MARKER)):
            try:
                content = json.loads(fs.cat_file(marker))
            except (ValueError, FileNotFoundError):
                continue
            step = content.get("step")
            path = fs.unstrip_protocol(marker.rsplit("/", 1)[0])
            found.append(
                ObjectCheckpointInfo(
                    path=path, step=step if isinstance(step, int) else None, time=content.get("time", 0)
                )
            )
        return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.time, c.path))

    def remove(self, path: str) -> None:
        """Delete checkpoint ``path``: its marker first, so it is never seen committed and incomplete."""
        fs, root = self._fs(str(path))
        marker = _join(root, COMMIT_MARKER)
        if fs.exists(marker):
            fs.rm_file(marker)
        if fs.exists(root):
            fs.rm(root, recursive=True)

    def cleanup_uncommitted(self, dirpath: str, *, keep: Iterable[str] = ()) -> list[str]:
        """Remove the prefixes under ``dirpath`` without a marker that hold lightning-ft data objects, except ``keep``.

        Prefixes without our data objects (another tool's files) are left alone. Returns the removed URLs.
        """
        fs, root = self._fs(str(dirpath))
        kept = {self._fs(str(k))[1].rstrip("/") for k in keep}
        removed = []
        for child in fs.ls(root, detail=True):
            name = child["name"].rstrip("/")
            if child["type"] != "directory" or name in kept or fs.exists(_join(name, COMMIT_MARKER)):
                continue
            if not fs.glob(_join(name, "data", "*.json")) and not fs.exists(_join(name, "data", "0")):
                continue
            fs.rm(name, recursive=True)
            removed.append(fs.unstrip_protocol(name))
        return removed


class ObjectReader:
    """Reads one checkpoint's entries by ``(rank, entry)`` with ranged reads. Obtained from :meth:`ObjectStore.reader`."""

    def __init__(self, store: ObjectStore, path: str) -> None:
        self._fs, self._root = store._fs(path)
        self._indexes: dict[int, dict[str, list[int]]] = {}

    def _index(self, rank: int) -> dict[str, list[int]]:
        if rank not in self._indexes:
            try:
                self._indexes[rank] = json.loads(self._fs.cat_file(_join(self._root, "data", f"{rank}.json")))
            except FileNotFoundError:
                self._indexes[rank] = {}
        return self._indexes[rank]

    def files(self, rank: int, name: str) -> list[str]:
        return [f"data/{rank}"] if name in self._index(rank) else []

    def unsafe_entries(self) -> list[str]:
        return []  # entries are raw bytes

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Read entry ``name`` of ``rank`` into the CPU ``uint8`` tensor ``out``; ``KeyError``/``FileNotFoundError``/
        ``EOFError`` as the filesystem reader."""
        entry = self._index(rank).get(name)
        if entry is None:
            raise KeyError(f"{rank}/{name}")
        start, length = entry
        data = self._fs.cat_file(_join(self._root, "data", str(rank)), start=start, end=start + length)
        if len(data) != length or length != out.numel():
            raise EOFError(f"data/{rank} is shorter than its index says")
        out.numpy()[:] = memoryview(data)
