"""The storage seam: the only module that imports torchsnapshot.

:class:`SnapshotStorage` writes one flat ``{name: CPU tensor}`` dict per rank into a torchsnapshot directory and reads
entries back by ``(rank, name)``; any rank can read any rank's entries. Everything lightning-ft-specific (the index,
checksums, DTensor geometry, JSON state, the commit marker) lives outside torchsnapshot, in our own metadata.

torchsnapshot's filesystem plugin never fsyncs, so writes go through :class:`_DurableFSPlugin`, which writes every file
without the page cache where the filesystem allows it (:mod:`~lightning_ft.checkpoint.direct_write`), fsyncs it and
the directories it created. It also holds back an I/O error (e.g. ``ENOSPC``) until the collective ``Snapshot.take``
has finished on every rank: raising in the middle would leave the other ranks waiting in torchsnapshot's barrier.
Tests replace the whole class with a fake whose ``write`` raises, to inject a full disk.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

with warnings.catch_warnings():
    # torchsnapshot compiles two helpers with `@torch.jit.script` when it is imported; torch 2.15 deprecates that with
    # a FutureWarning the user can do nothing about (torchsnapshot is no longer developed), printed by every process
    # that imports lightning-ft. The helpers still work.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
    from torchsnapshot import Snapshot, StateDict
    from torchsnapshot.io_types import WriteIO
    from torchsnapshot.manifest import ChunkedTensorEntry, ObjectEntry, TensorEntry
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

from lightning_ft import _compat
from lightning_ft.checkpoint.direct_write import write_file

_APP_KEY = "shards"
_SAFE_SERIALIZER = "buffer_protocol"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DurableFSPlugin(FSStoragePlugin):
    """torchsnapshot's filesystem plugin plus fsync of every file and directory; defers the first write error."""

    def __init__(self, root: str, *, direct: bool = True) -> None:
        super().__init__(root=root)
        self.direct = direct
        self.error: BaseException | None = None
        self.dirs: set[Path] = set()
        self._lock = threading.Lock()

    async def write(self, write_io: WriteIO) -> None:
        if self.error is not None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._write_sync, write_io)
        except Exception as e:  # noqa: BLE001 - re-raised by SnapshotStorage.write after the collective take
            with self._lock:
                if self.error is None:
                    self.error = e

    def _write_sync(self, write_io: WriteIO) -> None:
        path = Path(self.root) / write_io.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.dirs.add(path.parent)
        buf = write_io.buf
        # One file, written sequentially, one fsync: a batch of small entries arrives as its parts, not copied.
        parts = buf.parts if isinstance(buf, _compat.GatheredBuffer) else [memoryview(buf).cast("B")]
        write_file(path, parts, direct=self.direct)


class SnapshotReader:
    """Reads one committed snapshot's entries. Obtained from :meth:`SnapshotStorage.reader`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._manifest = Snapshot(path=str(self.path)).metadata.manifest

    def _entry(self, rank: int, name: str) -> Any:
        return self._manifest.get(f"{rank}/{_APP_KEY}/{name}")

    def files(self, rank: int, name: str) -> list[str]:
        """Files (relative to the checkpoint) holding entry ``name`` of ``rank``; ``[]`` if the manifest lacks it."""
        entry = self._entry(rank, name)
        if isinstance(entry, ChunkedTensorEntry):
            return [chunk.tensor.location for chunk in entry.chunks]
        if isinstance(entry, TensorEntry):
            return [entry.location]
        return []

    def unsafe_entries(self) -> list[str]:
        """Manifest entries that would be loaded through unpickling (object entries, ``torch_save`` tensors)."""
        unsafe = []
        for key, entry in self._manifest.items():
            if isinstance(entry, ObjectEntry):
                unsafe.append(f"{key} (pickled object, file {entry.location})")
            elif isinstance(entry, TensorEntry) and entry.serializer != _SAFE_SERIALIZER:
                unsafe.append(f"{key} (serializer {entry.serializer}, file {entry.location})")
            elif isinstance(entry, ChunkedTensorEntry):
                unsafe += [
                    f"{key} (serializer {c.tensor.serializer}, file {c.tensor.location})"
                    for c in entry.chunks
                    if c.tensor.serializer != _SAFE_SERIALIZER
                ]
        return unsafe

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Read entry ``name`` written by ``rank`` into the CPU uint8 tensor ``out`` (sized to the entry).

        Raises ``KeyError`` if the manifest lacks the entry, ``FileNotFoundError`` if a file is gone, ``EOFError`` if a
        file is too short.
        """
        entry = self._entry(rank, name)
        if entry is None:
            raise KeyError(f"{rank}/{_APP_KEY}/{name}")
        buffer = out.numpy()
        if isinstance(entry, TensorEntry):
            self._read_raw(entry, buffer, 0)
        elif isinstance(entry, ChunkedTensorEntry):
            for chunk in entry.chunks:
                self._read_raw(chunk.tensor, buffer, chunk.offsets[0], chunk.sizes[0])
        else:
            raise TypeError(f"entry {rank}/{_APP_KEY}/{name} is a {type(entry).__name__}, not a tensor")

    def _read_raw(self, entry: TensorEntry, buffer: Any, offset: int, size: int | None = None) -> None:
        # Entries are raw bytes (buffer-protocol serializer, uint8), so a plain read is exact and needs no event loop.
        if entry.serializer != _SAFE_SERIALIZER or entry.dtype != "torch.uint8":
            raise TypeError(f"{entry.location}: serializer {entry.serializer}, dtype {entry.dtype} (not written by us)")
        start, end = entry.byte_range if entry.byte_range is not None else (0, None)
        size = (end - start if end is not None else len(buffer) - offset) if size is None else size
        target = memoryview(buffer[offset : offset + size])
        with open(self.path / entry.location, "rb") as f:
            f.seek(start)
            if f.readinto(target) != size:
                raise EOFError(f"{entry.location} is shorter than its manifest says")


class SnapshotStorage:
    """Writes and reads flat per-rank tensor dicts through torchsnapshot, durably.

    Example::

        storage = SnapshotStorage()
        storage.write(Path("ckpt"), {"t0": torch.arange(4, dtype=torch.uint8)}, group=None)
        out = torch.empty(4, dtype=torch.uint8)
        storage.reader(Path("ckpt")).read(0, "t0", out)
    """

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io
        """Write data files with ``O_DIRECT`` where the filesystem accepts it (falls back to buffered writes)."""

    def write(self, path: Path, entries: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None) -> None:
        """Write this rank's ``entries`` (CPU tensors) into the snapshot at ``path`` and fsync them.

        Collective over ``group`` (every rank calls, with the same ``path``); raises the first I/O error of this rank
        only after the collective part has finished everywhere. Entries must be 1-D ``uint8`` tensors: every entry then
        uses torchsnapshot's buffer-protocol serializer, so reading never goes through ``torch.load``. A substitute
        (a test fake) that fails on some ranks only must still take part in the collective write before raising.
        """
        plugin = _DurableFSPlugin(root=str(path), direct=self.direct_io)
        with _compat.torchsnapshot_take_hooks(plugin):
            Snapshot.take(path=str(path), app_state={_APP_KEY: StateDict(dict(entries))}, pg=group)
        if plugin.error is not None:
            raise plugin.error
        for directory in sorted(plugin.dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(directory)
        fsync_dir(path)
        fsync_dir(path.parent)

    def reader(self, path: Path) -> SnapshotReader:
        """A reader for the snapshot at ``path``; raises ``RuntimeError`` if torchsnapshot's own metadata is missing."""
        return SnapshotReader(path)
