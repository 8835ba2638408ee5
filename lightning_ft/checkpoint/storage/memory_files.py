"""The storage of the memory tier: one plain file per shard in a folder of node-local memory.

The durable tier writes through torchsnapshot, whose writes are collective over a process group; a memory copy is
written by one rank alone, from its background thread, and must never take part in a collective. This storage fills
the same seam (``write`` and ``reader``; :class:`~lightning_ft.checkpoint.shard_reader.ShardReader` reads and checks
it) with files ``shards/<entry>``: the bytes of one staged tensor each, nothing pickled. The index, the checksums and
the commit marker are the checkpoint package's own (:mod:`~lightning_ft.checkpoint.commit`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["MemoryFileReader", "MemoryFileStorage"]

SHARDS = "shards"
"""Sub-folder of a memory copy that holds its shard files."""


class MemoryFileStorage:
    """Writes and reads one rank's flat tensor dict as one file per entry. Not collective.

    Example::

        storage = MemoryFileStorage()
        storage.write(Path("/dev/shm/copy"), {"t0": torch.arange(4, dtype=torch.uint8)}, group=None)
    """

    def write(self, path: Path, entries: Mapping[str, torch.Tensor], *, group: dist.ProcessGroup | None = None) -> None:
        """Write ``entries`` (1-D ``uint8`` CPU tensors) under ``path/shards/``. ``group`` is ignored (the seam's
        signature): this rank alone writes. Raises the ``OSError`` of a full or missing folder as it comes."""
        folder = Path(path) / SHARDS
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in entries.items():
            with open(folder / name, "wb") as f:
                f.write(memoryview(data.numpy()))

    def reader(self, path: Path) -> MemoryFileReader:
        return MemoryFileReader(Path(path))


class MemoryFileReader:
    """Reads the entries of one memory copy (``rank`` is the writer's, always 0 within a copy)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def files(self, rank: int, name: str) -> list[str]:
        relative = f"{SHARDS}/{name}"
        return [relative] if (self.path / relative).is_file() else []

    def unsafe_entries(self) -> list[str]:
        return []  # raw bytes only: there is nothing that could be unpickled

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8, sized to the entry) from the entry's file. Raises ``FileNotFoundError`` when it is gone
        and ``EOFError`` when it is shorter or longer than the index says."""
        file = self.path / SHARDS / name
        size = out.numel()
        with open(file, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise EOFError(f"{file} holds {os.fstat(f.fileno()).st_size} bytes, the index says {size}")
            if f.readinto(memoryview(out.numpy())) != size:
                raise EOFError(f"{file} is shorter than the index says")
