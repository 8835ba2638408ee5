"""Reading stored shards back and checking them: used by :func:`~lightning_ft.checkpoint.load_checkpoint` and by
:func:`~lightning_ft.checkpoint.verify`.

A shard is read as raw bytes (never through unpickling), checked against the crc32 recorded at save, and viewed as the
dtype and shape the index records. :meth:`ShardReader.assemble` builds any box of a tensor from whichever stored shards
overlap it, which is what lets a checkpoint load into another world size or mesh. :meth:`ShardReader.read_into` is the
common case without a copy: when one stored shard is exactly the box a destination tensor needs (the same world and
mesh, or a tensor written whole) and that tensor is a contiguous CPU tensor of the stored dtype, the shard's bytes are
read straight into it and checked there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_ft.checkpoint.checksum import crc32
from lightning_ft.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

__all__ = ["ShardReader"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


class ShardReader:
    """Reads and checks the shards of one checkpoint whose metadata ``document`` has been read.

    Not collective; any process may read any rank's shards.

    Raises:
        CorruptCheckpointError: torchsnapshot's own metadata is unreadable.
        UnsafeCheckpointError: the snapshot holds an entry that would be loaded through unpickling.

    Example::

        reader = ShardReader(path, read_document(path), SnapshotStorage(), verify_checksums=True)
        weight = reader.assemble("model/weight", [0, 0], [16, 8])
    """

    def __init__(self, path: Path, document: dict[str, Any], storage: SnapshotStorage, *, verify_checksums: bool):
        self.path = path
        self.document = document
        self.verify_checksums = verify_checksums
        try:
            self.reader = storage.reader(path)
        except CheckpointError:
            raise  # a checkpoint file's own refusal (unsafe, corrupt) says why
        except Exception as e:  # noqa: BLE001 - torchsnapshot reports a missing manifest as RuntimeError
            raise CorruptCheckpointError(f"checkpoint {path}: torchsnapshot metadata unreadable ({e})") from e
        unsafe = self.reader.unsafe_entries()
        if unsafe:
            raise UnsafeCheckpointError(
                f"checkpoint {path} holds pickled payloads, which lightning-ft never loads: {', '.join(unsafe)}"
            )

    def read_shard(self, key: str, record: dict[str, Any], shard: dict[str, Any]) -> torch.Tensor:
        """One stored shard of tensor ``key`` as a CPU tensor of the shard's shape, checksum checked."""
        out = torch.empty(shard["nbytes"], dtype=torch.uint8)
        self._read_checked(key, shard, out)
        return out.view(_dtype(record["dtype"])).reshape(shard["shape"])

    def read_into(self, key: str, offset: list[int], target: torch.Tensor) -> bool:
        """Fill ``target`` (the box of tensor ``key`` at ``offset``) straight from the one stored shard that is exactly
        that box, with no intermediate buffer; returns False, touching nothing, when no shard is, or ``target`` is not
        a contiguous CPU tensor of the stored dtype (then :meth:`assemble` builds it).

        Raises:
            CorruptCheckpointError: the shard is missing, unreadable or fails its checksum (``target`` then holds
                whatever was read: the load fails).
        """
        record = self.document["tensors"].get(key)
        if record is None or target.is_cuda or not target.is_contiguous() or target.layout != torch.strided:
            return False
        if target.dtype != _dtype(record["dtype"]):
            return False
        shape = list(target.shape)
        for shard in record["shards"]:
            if list(shard["offset"]) == list(offset) and list(shard["shape"]) == shape:
                out = target.reshape(-1).view(torch.uint8)
                if out.numel() != shard["nbytes"]:
                    return False
                self._read_checked(key, shard, out)
                return True
        return False

    def _read_checked(self, key: str, shard: dict[str, Any], out: torch.Tensor) -> None:
        rank, name = shard["rank"], shard["entry"]
        files = self.reader.files(rank, name)
        where = f"tensor {key!r} (entry {rank}/{name}, file {', '.join(files) or 'absent from the manifest'})"
        if not files:
            raise CorruptCheckpointError(f"checkpoint {self.path}: missing shard of {where}")
        try:
            self.reader.read(rank, name, out)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"checkpoint {self.path}: missing shard file of {where}") from e
        except Exception as e:  # noqa: BLE001 - torchsnapshot wraps short reads in various errors
            raise CorruptCheckpointError(f"checkpoint {self.path}: unreadable shard of {where}: {e}") from e
        if self.verify_checksums and crc32(out.numpy()) != shard["crc32"]:
            raise CorruptCheckpointError(f"checkpoint {self.path}: checksum mismatch in shard of {where}")

    def assemble(self, key: str, offset: list[int], shape: list[int]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of tensor ``key`` as a new CPU tensor, from overlapping shards."""
        record = self.document["tensors"].get(key)
        if record is None:
            raise CorruptCheckpointError(f"checkpoint {self.path}: tensor {key!r} is missing from the index")
        out = torch.empty(shape, dtype=_dtype(record["dtype"]))
        covered = 0
        for shard in record["shards"]:
            lo = [max(a, b) for a, b in zip(offset, shard["offset"], strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, shard["offset"], shard["shape"], strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            data = self.read_shard(key, record, shard)
            src = tuple(slice(low - s, h - s) for low, h, s in zip(lo, hi, shard["offset"], strict=True))
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offset, strict=True))
            out[dst] = data[src]
            covered += data[src].numel()
        if covered != out.numel():
            raise CorruptCheckpointError(
                f"checkpoint {self.path}: the stored shards of tensor {key!r} cover {covered} of the "
                f"{out.numel()} elements at offset {offset} shape {shape}"
            )
        return out
