"""The second on-disk format behind the storage seam: PyTorch's distributed checkpoint (DCP) layout.

:class:`DcpStorage` has the seam's interface (:class:`~lightning_ft.checkpoint.SnapshotStorage`'s ``write`` and
``reader``) and takes the same staged per-rank entries. Given their :class:`EntryLayout` (which logical tensor, dtype,
global shape and offset each entry is), every entry becomes a DCP chunk of its logical tensor, so the folder is an
ordinary DCP checkpoint: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one
``torch.save`` file of full tensors (nested as the checkpoint's keys), and ``torch.distributed.checkpoint.load`` reads
it into any sharding. Without a layout, entries are stored as flat ``uint8`` tensors named ``<rank>/<entry>``.

What lightning-ft adds, outside DCP's own files: ``lightning_ft_dcp_entries.json``, written by the coordinator after
DCP's ``.metadata``, maps each ``(rank, entry)`` to its file and byte range. :class:`DcpReader` reads entries through it
and the raw storage record inside the item, so reading never unpickles anything (DCP itself reads its ``.metadata``
with ``pickle.load``). Data files are fsync'd by DCP's writer (``sync_files=True``); the folder entries by us. Everything
else (index, checksums, commit marker, retention, fallback) stays with the code above the seam.
"""

from __future__ import annotations

import io
import json
import os
import struct
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lightning_ft.checkpoint.commit import atomic_write
from lightning_ft.checkpoint.snapshot_storage import fsync_dir

__all__ = ["ENTRIES_FILE", "DcpReader", "DcpStorage", "EntryLayout"]

ENTRIES_FILE = "lightning_ft_dcp_entries.json"
"""Where each rank's entries lie in the DCP files (file, byte range, logical key and offset)."""

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


@dataclass(frozen=True)
class EntryLayout:
    """What one staged entry is: a box of a logical tensor."""

    key: str
    """The logical tensor's key in the checkpoint index (``state_dict/net.0.weight``)."""
    dtype: str
    """Its dtype without ``torch.`` (``float32``)."""
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Offset of the box in the global tensor."""
    shape: tuple[int, ...]
    """Shape of the box (the entry's bytes are this box, C-contiguous)."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class _EntryPlanner(DefaultSavePlanner):
    """Plans exactly one DCP chunk per staged entry, at the entry's place in its logical tensor."""

    def __init__(
        self,
        chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]],
        paths: dict[str, tuple[str, ...]],
    ) -> None:
        super().__init__(flatten_state_dict=True)
        self._chunks = chunks  # (fqn, offset) -> (tensor shaped like the box, global shape)
        self._paths = paths  # fqn -> the key's path

    def create_local_plan(self) -> SavePlan:
        items = []
        for (fqn, offset), (tensor, global_shape) in self._chunks.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=tensor.size()),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size(global_shape),
                    ),
                )
            )
        # dcp_to_torch_save nests the keys back into dicts by this mapping (DCP names a nested key by its path
        # joined with dots, as its own flattening does).
        mapping = {fqn: path for fqn, path in self._paths.items()}
        self.plan = SavePlan(items, planner_data=mapping)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._chunks[(write_item.index.fqn, tuple(write_item.index.offset or ()))][0]


def _fsync_tree(path: Path) -> None:
    for child in path.iterdir():
        try:
            fd = os.open(child, os.O_RDONLY)
        except (FileNotFoundError, IsADirectoryError):
            # Another rank's temporary file, renamed away since the listing (rank 0 writes the entry table while the
            # others sync): atomic_write made it durable itself.
            continue
        try:
            if os.path.isfile(child):
                os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(path)
    fsync_dir(path.parent)


class DcpStorage:
    """Writes and reads flat per-rank entries as a DCP checkpoint folder, durably.

    Example::

        storage = DcpStorage()
        data = torch.arange(4, dtype=torch.float32)
        layout = {"t0": EntryLayout("w", "float32", (4,), (0,), (4,))}
        storage.write(Path("ckpt"), {"t0": data.view(torch.uint8)}, group=None, layout=layout)
        out = torch.empty(16, dtype=torch.uint8)
        storage.reader(Path("ckpt")).read(0, "t0", out)
    """

    name = "dcp"
    """The format name recorded in a checkpoint's metadata."""

    def write(
        self,
        path: Path,
        entries: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None,
        layout: Mapping[str, EntryLayout] | None = None,
    ) -> None:
        """Write this rank's ``entries`` (1-D ``uint8`` CPU tensors) into the DCP folder ``path`` and fsync them.

        Collective over ``group`` (every rank calls, with the same ``path``): DCP plans on every rank, its coordinator
        writes ``.metadata``, then rank 0 of ``group`` writes :data:`ENTRIES_FILE`. A failure on any rank raises on every
        rank after the collective part (DCP gathers them). ``layout`` maps entry names to their logical tensor; entries
        without one are stored as ``uint8`` tensors named ``<rank>/<entry>``.
        """
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, tuple[int, ...]]] = {}
        where: dict[str, tuple[str, tuple[int, ...]]] = {}
        paths: dict[str, tuple[str, ...]] = {}
        for name, data in entries.items():
            spec = (layout or {}).get(name)
            if spec is None:
                key, offset, tensor, global_shape = f"{rank}/{name}", (0,), data, tuple(data.shape)
            else:
                tensor = data.view(_dtype(spec.dtype)).reshape(spec.shape)
                key, offset, global_shape = spec.key, tuple(spec.offset), tuple(spec.global_shape)
            path_of_key = tuple(key.split("/"))
            fqn = ".".join(path_of_key)
            if paths.setdefault(fqn, path_of_key) != path_of_key:
                raise ValueError(f"keys {key!r} and {'/'.join(paths[fqn])!r} have the same DCP name {fqn!r}")
            chunks[(fqn, offset)] = (tensor, global_shape)
            where[f"{rank}/{name}"] = (fqn, offset)
        import torch.distributed.checkpoint as dcp

        try:
            with warnings.catch_warnings():
                # Without torch.distributed DCP warns that it saves in one process, which is what no_dist asks for.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                metadata = dcp.save(
                    {},  # the planner writes the entries; DCP's state dict walk has nothing to add
                    storage_writer=FileSystemWriter(str(path), sync_files=True, overwrite=True),
                    planner=_EntryPlanner(chunks, paths),
                    process_group=group,
                    no_dist=not distributed,
                )
        except CheckpointException as e:
            # DCP gathers every rank's failure into one BaseException on every rank. The seam raises this rank's own
            # error (an OSError keeps its errno: ENOSPC reaches the user as such); a rank whose own data is durable
            # returns, and the writer's exchange names the rank that failed.
            own = e.failures.get(rank)
            if own is not None:
                raise own[0] from None
            return
        gathered: list[Any] = [where]
        if distributed:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, where, group=group)
        if rank == 0:
            located = {}
            for index, info in metadata.storage_data.items():
                located[(index.fqn, tuple(index.offset or ()))] = {
                    "file": info.relative_path,
                    "start": info.offset,
                    "length": info.length,
                }
            table = {
                entry: {"key": fqn, "offset": list(offset), **located[(fqn, offset)]}
                for per_rank in gathered
                for entry, (fqn, offset) in per_rank.items()
            }
            atomic_write(Path(path) / ENTRIES_FILE, json.dumps(table).encode())
        _fsync_tree(Path(path))

    def reader(self, path: Path) -> DcpReader:
        """A reader for the DCP folder ``path``; raises ``FileNotFoundError`` if :data:`ENTRIES_FILE` is missing."""
        return DcpReader(path)


class _Slice(io.RawIOBase):
    """The byte range ``[start, start + length)`` of an open file, as a seekable file of its own."""

    def __init__(self, raw: Any, start: int, length: int) -> None:
        self._raw, self._start, self._length, self._pos = raw, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        self._raw.seek(self._start + self._pos)
        got = self._raw.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


class DcpReader:
    """Reads one DCP folder's entries by ``(rank, entry)``, never unpickling. Obtained from :meth:`DcpStorage.reader`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._table: dict[str, dict[str, Any]] = json.loads((self.path / ENTRIES_FILE).read_bytes())

    def files(self, rank: int, name: str) -> list[str]:
        """Files (relative to the checkpoint) holding entry ``name`` of ``rank``; ``[]`` if it is not recorded."""
        entry = self._table.get(f"{rank}/{name}")
        return [entry["file"]] if entry else []

    def unsafe_entries(self) -> list[str]:
        """Always empty: entries are read as raw storage bytes, never through ``torch.load``."""
        return []

    def read(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Read entry ``name`` written by ``rank`` into the CPU ``uint8`` tensor ``out`` (sized to the entry).

        Raises ``KeyError`` if the entry is not recorded, ``FileNotFoundError`` if its file is gone, ``EOFError`` if
        its bytes are short or not a tensor record of that size.
        """
        entry = self._table.get(f"{rank}/{name}")
        if entry is None:
            raise KeyError(f"{rank}/{name}")
        with open(self.path / entry["file"], "rb") as raw:
            item = _Slice(raw, entry["start"], entry["length"])
            try:
                with zipfile.ZipFile(item) as zf:
                    info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
            except (zipfile.BadZipFile, StopIteration, OSError, ValueError) as e:
                raise EOFError(f"{entry['file']}: the item of {rank}/{name} is not a complete tensor record") from e
            if info.file_size != out.numel():
                raise EOFError(f"{entry['file']}: {rank}/{name} holds {info.file_size} bytes, not {out.numel()}")
            item.seek(info.header_offset)
            header = item.read(_LOCAL_HEADER.size)
            if len(header) != _LOCAL_HEADER.size:
                raise EOFError(f"{entry['file']} is shorter than its index says")
            fields = _LOCAL_HEADER.unpack(header)
            item.seek(info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10])
            if item.readinto(out.numpy()) != out.numel():
                raise EOFError(f"{entry['file']} is shorter than its index says")
