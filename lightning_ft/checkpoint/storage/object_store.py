"""Checkpoints in object storage (S3, GCS, Azure, ...) through fsspec, committed without rename or link.

Object stores have no rename, no link and no fsync, but a PUT is atomic: an object is seen whole or not at all, and a
PUT over an existing object replaces it whole. So the commit protocol needs no temporary names:

- a save to ``<ckpt>`` writes into a generation prefix of its own, ``<ckpt>/lft-<token>/``: rank 0 first PUTs the
  in-progress record there (:meth:`ObjectStore.prepare`), then every rank PUTs its entries as one object
  ``data/<rank>`` and their byte ranges as ``data/<rank>.json`` (:meth:`ObjectStore.write`);
- rank 0 PUTs the metadata object into the generation, then the marker object ``<ckpt>/lightning_ft.committed``, last,
  naming the generation (:meth:`ObjectStore.commit`). A checkpoint counts when its marker exists; readers follow the
  marker to its generation. Replacing a committed checkpoint is one more marker PUT: the old generation stays committed
  until that instant, and is deleted afterwards;
- the newest checkpoint (``last``) is found by listing the markers (:meth:`ObjectStore.list_committed`), never through
  a link; a checkpoint is removed marker first (:meth:`ObjectStore.remove`);
- what lightning-ft may delete is what it can prove it wrote: a marker, or a generation prefix holding our in-progress
  record or data index (:meth:`ObjectStore.cleanup_uncommitted`). Another tool's objects are left alone.

Paths are fsspec URLs (``s3://bucket/ckpts/step=100``, ``memory://ckpts/step=100``). The strategy passes paths around
as :class:`pathlib.Path`, which folds ``s3://`` into ``s3:/``; :func:`as_url` restores the URL, :func:`is_remote` says
whether a path is one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from lightning_ft.checkpoint.commit import COMMIT_MARKER, FORMAT_VERSION, METADATA_FILE
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
)
from lightning_ft.checkpoint.in_progress import IN_PROGRESS_RECORD

__all__ = ["ObjectCheckpointInfo", "ObjectCommit", "ObjectReader", "ObjectStore", "as_url", "is_remote"]

_FOLDED = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*):/+(?P<rest>.*)$")
_GENERATION = re.compile(r"^lft-[0-9a-f]{16}$")
_LOCAL = (None, "file", "local")


def as_url(path: str | os.PathLike) -> str:
    """``path`` as an fsspec URL: ``s3:/bucket/k`` (a URL that went through ``pathlib.Path``) becomes ``s3://bucket/k``;
    anything else is returned as it is."""
    text = os.fspath(path)
    if "://" in text:
        return text
    match = _FOLDED.match(text)
    if match is None or match["protocol"] in ("file", "local") or len(match["protocol"]) < 2:
        return text
    return f"{match['protocol']}://{match['rest']}"


def protocol_of(path: str | os.PathLike) -> str | None:
    """The fsspec protocol of ``path`` (``"s3"``, ``"memory"``), or ``None`` for a local path."""
    return fsspec.core.split_protocol(as_url(path))[0]


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object-store URL (any fsspec protocol but the local filesystem's)."""
    return protocol_of(path) not in _LOCAL


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


@dataclass(frozen=True)
class ObjectCheckpointInfo:
    """A committed checkpoint found by listing marker objects."""

    path: str
    """The checkpoint's URL (no trailing slash)."""
    step: int | None
    time: float
    """The commit time recorded in its marker (object stores' modification times are not comparable across stores)."""
    full_state: bool | None = None
    """The marker's ``full_state``; ``None`` when it does not say."""


class ObjectCommit:
    """One committed save, until :meth:`finish` (delete what it replaced) or :meth:`undo` (put it back)."""

    def __init__(self, store: ObjectStore, folder: str, previous: bytes | None) -> None:
        self._store, self.folder, self._previous = store, folder, previous
        self.path = folder.rsplit("/", 1)[0]

    def finish(self) -> None:
        """Remove the in-progress record and the generation the new marker replaced."""
        fs, root = self._store._fs(self.folder)
        fs.rm_file(_join(root, IN_PROGRESS_RECORD))
        old = _generation(self._previous)
        if old is not None and old != self.folder.rsplit("/", 1)[1]:
            self._store._remove_prefix(_join(self.path, old))

    def undo(self) -> None:
        """Put the marker it replaced back (or remove its own), then delete its generation."""
        fs, root = self._store._fs(self.path)
        marker = _join(root, COMMIT_MARKER)
        if self._previous is not None:
            fs.pipe_file(marker, self._previous)
        elif fs.exists(marker):
            fs.rm_file(marker)
        self._store.discard(self.folder)


def _generation(marker: bytes | None) -> str | None:
    try:
        value = json.loads(marker).get("generation") if marker else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _GENERATION.match(value) else None


class ObjectStore:
    """Writes, reads, commits, lists and removes checkpoints under fsspec URLs.

    Args:
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, endpoint, ...).

    Example::

        store = ObjectStore()
        folder = store.prepare("s3://bucket/ckpts/step=100", step=100, run_id=None)  # rank 0
        store.write(folder, entries, group=None)  # every rank
        store.commit(folder, document, step=100).finish()  # rank 0, after every rank wrote
        store.list_committed("s3://bucket/ckpts")[-1].path  # the newest: what `last` means here
    """

    name = "object_store"

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self._options = dict(storage_options or {})

    def _fs(self, url: str | os.PathLike) -> tuple[Any, str]:
        fs, path = fsspec.core.url_to_fs(as_url(url), **self._options)
        return fs, path.rstrip("/")

    def _url(self, fs: Any, path: str) -> str:
        return as_url(fs.unstrip_protocol(path))

    # -- writing ---------------------------------------------------------------------------------------------------

    def prepare(self, path: str | os.PathLike, *, step: int | None, run_id: str | None) -> str:
        """Rank 0, before any data: create the generation the save to ``path`` writes into, with its in-progress
        record; return its URL.

        Raises:
            CheckpointError: ``path`` holds objects lightning-ft cannot prove it wrote (no marker, no generation of
                ours); nothing is touched.
        """
        fs, root = self._fs(path)
        if not self.is_ours(path) and _listing(fs, root):
            raise CheckpointError(
                f"cannot save to {as_url(path)}: it holds objects lightning-ft cannot prove it wrote (no commit"
                " marker, no generation of ours), so they are left alone; remove them or save to another path"
            )
        generation = f"lft-{uuid.uuid4().hex[:16]}"
        record = {"target": root.rsplit("/", 1)[-1], "step": step, "run_id": run_id, "time": time.time()}
        record.update(host=socket.gethostname(), pid=os.getpid(), generation=generation)
        fs.pipe_file(_join(root, generation, IN_PROGRESS_RECORD), json.dumps(record).encode())
        return self._url(fs, _join(root, generation))

    def write(
        self, path: str | os.PathLike, entries: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None
    ) -> None:
        """Write this rank's ``entries`` (1-D ``uint8`` CPU tensors) into generation ``path`` as one data object and
        its index. Every rank calls it; it does no communication. The index is written after the data object, so an
        index always describes a complete data object."""
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        fs, root = self._fs(path)
        index, start = {}, 0
        with fs.open(_join(root, "data", str(rank)), "wb") as f:
            for name, data in entries.items():
                buffer = memoryview(data.contiguous().numpy())
                f.write(buffer)
                index[name] = [start, len(buffer)]
                start += len(buffer)
        fs.pipe_file(_join(root, "data", f"{rank}.json"), json.dumps(index).encode())

    def commit(
        self, folder: str | os.PathLike, document: dict[str, Any], *, step: int | None, full_state: bool | None = None
    ) -> ObjectCommit:
        """Rank 0, after every rank's :meth:`write` returned: the metadata object into generation ``folder``, then the
        marker object of its checkpoint, last. Returns the handle that finishes or undoes the commit."""
        fs, root = self._fs(folder)
        checkpoint, generation = root.rsplit("/", 1)
        data = json.dumps(document, allow_nan=False).encode()
        fs.pipe_file(_join(root, METADATA_FILE), data)
        marker: dict[str, Any] = {"format_version": FORMAT_VERSION, "step": step}
        if full_state is not None:
            marker["full_state"] = full_state
        marker.update(time=time.time(), metadata_crc32=zlib.crc32(data), generation=generation)
        marker_path = _join(checkpoint, COMMIT_MARKER)
        previous = fs.cat_file(marker_path) if fs.exists(marker_path) else None
        fs.pipe_file(marker_path, json.dumps(marker).encode())
        return ObjectCommit(self, self._url(fs, root), previous)

    def discard(self, folder: str | os.PathLike) -> None:
        """Delete generation ``folder`` (a failed or replaced save); never one the checkpoint's marker names."""
        fs, root = self._fs(folder)
        checkpoint, generation = root.rsplit("/", 1)
        if _GENERATION.match(generation) and self._committed_generation(fs, checkpoint) != generation:
            self._remove_prefix(self._url(fs, root))

    def _remove_prefix(self, url: str) -> None:
        fs, root = self._fs(url)
        if _listing(fs, root):
            fs.rm(root, recursive=True)

    # -- reading ---------------------------------------------------------------------------------------------------

    def _marker(self, fs: Any, root: str) -> dict[str, Any] | None:
        try:
            marker = json.loads(fs.cat_file(_join(root, COMMIT_MARKER)))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"checkpoint {self._url(fs, root)}: commit marker is not valid JSON") from e
        return marker if isinstance(marker, dict) else {}

    def _committed_generation(self, fs: Any, root: str) -> str | None:
        try:
            return _generation(fs.cat_file(_join(root, COMMIT_MARKER)))
        except FileNotFoundError:
            return None

    def exists(self, path: str | os.PathLike) -> bool:
        """Whether any object lies at or under ``path``."""
        fs, root = self._fs(path)
        return bool(_listing(fs, root)) or fs.exists(root)

    def is_committed(self, path: str | os.PathLike) -> bool:
        fs, root = self._fs(path)
        return fs.exists(_join(root, COMMIT_MARKER))

    def is_ours(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` holds our marker or a generation of ours (in-progress record or data index)."""
        fs, root = self._fs(path)
        return fs.exists(_join(root, COMMIT_MARKER)) or bool(self._generations(fs, root))

    def _generations(self, fs: Any, root: str) -> list[str]:
        found = []
        for child in _listing(fs, root):
            name = child.rstrip("/").rsplit("/", 1)[-1]
            if _GENERATION.match(name) and (
                fs.exists(_join(root, name, IN_PROGRESS_RECORD)) or fs.glob(_join(root, name, "data", "*.json"))
            ):
                found.append(name)
        return found

    def read_document(self, path: str | os.PathLike) -> dict[str, Any]:
        """The metadata document of committed checkpoint ``path``, checked against its marker's checksum.

        Raises:
            CheckpointNotFoundError: nothing exists at ``path``.
            UncommittedCheckpointError: no marker.
            CorruptCheckpointError: the marker or the metadata is unreadable or does not match.
            FormatVersionError: an unknown format version.
        """
        fs, root = self._fs(path)
        marker = self._marker(fs, root)
        if marker is None:
            if not _listing(fs, root):
                raise CheckpointNotFoundError(f"checkpoint {as_url(path)} does not exist")
            raise UncommittedCheckpointError(f"checkpoint {as_url(path)} has no commit marker {COMMIT_MARKER}")
        generation = marker.get("generation")
        try:
            data = fs.cat_file(_join(root, str(generation), METADATA_FILE))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {as_url(path)}: its metadata object is missing") from None
        if marker.get("metadata_crc32") not in (None, zlib.crc32(data)):
            raise CorruptCheckpointError(f"checkpoint {as_url(path)}: {METADATA_FILE} does not match its marker")
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"checkpoint {as_url(path)}: {METADATA_FILE} is not valid JSON") from e
        if not isinstance(document, dict) or document.get("format_version") != FORMAT_VERSION:
            version = document.get("format_version") if isinstance(document, dict) else None
            raise FormatVersionError(
                f"checkpoint {as_url(path)} has format version {version!r}; this lightning-ft reads {FORMAT_VERSION}"
            )
        return document

    def reader(self, path: str | os.PathLike) -> ObjectReader:
        """A reader for committed checkpoint ``path`` (its marker's generation)."""
        fs, root = self._fs(path)
        generation = self._committed_generation(fs, root)
        if generation is None:
            raise UncommittedCheckpointError(f"checkpoint {as_url(path)} has no commit marker {COMMIT_MARKER}")
        return ObjectReader(fs, _join(root, generation))

    # -- discovery and removal -------------------------------------------------------------------------------------

    def list_committed(self, dirpath: str | os.PathLike) -> list[ObjectCheckpointInfo]:
        """Committed checkpoints directly under ``dirpath``, by step ascending (``None`` first), then commit time.

        Found by listing marker objects: the last one is the newest checkpoint, the object-store ``last``.
        """
        fs, root = self._fs(dirpath)
        found = []
        for marker in fs.glob(_join(root, "*", COMMIT_MARKER)):
            try:
                content = json.loads(fs.cat_file(marker))
            except (ValueError, FileNotFoundError, UnicodeDecodeError):
                continue
            step, full_state = content.get("step"), content.get("full_state")
            found.append(
                ObjectCheckpointInfo(
                    path=self._url(fs, marker.rsplit("/", 1)[0]),
                    step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                    time=float(content.get("time") or 0),
                    full_state=full_state if isinstance(full_state, bool) else None,
                )
            )
        return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.time, c.path))

    def remove(self, path: str | os.PathLike) -> None:
        """Delete checkpoint ``path``: its marker first, so it is never seen committed and incomplete; then its
        generations. Objects of others under ``path`` are left."""
        fs, root = self._fs(path)
        marker = _join(root, COMMIT_MARKER)
        generations = self._generations(fs, root)
        committed = self._committed_generation(fs, root)
        if fs.exists(marker):
            fs.rm_file(marker)
        for generation in {*generations, *([committed] if committed else [])}:
            self._remove_prefix(self._url(fs, _join(root, generation)))
        if not _listing(fs, root) and fs.isdir(root):
            fs.rmdir(root)  # a filesystem with real directories (a local fake bucket) keeps an empty one

    def cleanup_uncommitted(self, dirpath: str | os.PathLike, *, keep: Iterable[str | os.PathLike] = ()) -> list[str]:
        """Delete the generations of ours under ``dirpath`` that no marker names (saves that never committed,
        checkpoints a crash left replaced), except those of the checkpoints in ``keep`` (a save in flight).

        Objects without our record or index (another tool's) are left alone. Returns the deleted generation URLs.
        """
        fs, root = self._fs(dirpath)
        kept = {self._fs(k)[1] for k in keep}
        removed = []
        for child in _listing(fs, root):
            checkpoint = child.rstrip("/")
            if checkpoint in kept:
                continue
            committed = self._committed_generation(fs, checkpoint)
            for generation in self._generations(fs, checkpoint):
                if generation != committed:
                    url = self._url(fs, _join(checkpoint, generation))
                    self._remove_prefix(url)
                    removed.append(url)
        return removed


def _listing(fs: Any, root: str) -> list[str]:
    try:
        return [p for p in fs.ls(root, detail=False) if p.rstrip("/") != root]
    except (FileNotFoundError, NotADirectoryError):
        return []


class ObjectReader:
    """Reads one checkpoint generation's entries by ``(rank, entry)`` with ranged reads. From
    :meth:`ObjectStore.reader`."""

    def __init__(self, fs: Any, root: str) -> None:
        self._fs, self._root = fs, root
        self._indexes: dict[int, dict[str, list[int]]] = {}

    def _index(self, rank: int) -> dict[str, list[int]]:
        if rank not in self._indexes:
            try:
                self._indexes[rank] = json.loads(self._fs.cat_file(_join(self._root, "data", f"{rank}.json")))
            except FileNotFoundError:
                self._indexes[rank] = {}
        return self._indexes[rank]

    def files(self, rank: int, name: str) -> list[str]:
        """Objects (relative to the generation) holding entry ``name`` of ``rank``; ``[]`` if it is not indexed."""
        return [f"{self._root.rsplit('/', 1)[-1]}/data/{rank}"] if name in self._index(rank) else []

    def unsafe_entries(self) -> list[str]:
        return []  # entries are raw bytes

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Read entry ``name`` of ``rank`` into the CPU ``uint8`` tensor ``out``; ``KeyError``/``FileNotFoundError``/
        ``EOFError`` as the filesystem readers."""
        entry = self._index(rank).get(name)
        if entry is None:
            raise KeyError(f"{rank}/{name}")
        start, length = entry
        data = self._fs.cat_file(_join(self._root, "data", str(rank)), start=start, end=start + length)
        if len(data) != length or length != out.numel():
            raise EOFError(f"data/{rank} is shorter than its index says")
        out.numpy()[:] = memoryview(data)
