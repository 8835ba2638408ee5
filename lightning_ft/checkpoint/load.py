"""Loading a committed checkpoint, on any world size and mesh.

:func:`load_checkpoint` refuses anything not committed, in an unknown format, holding a pickled payload, or with a
missing or corrupt shard, naming the path, the tensor and the file. Tensors in the caller's template are filled in place;
for a DTensor, its local region is computed from its own mesh and placements and assembled from whichever stored shards
overlap it, so a checkpoint written with 2 ranks loads into 1 or 4 ranks (``Shard``/``Replicate`` placements) and an
identical ``_StridedShard`` layout loads back bitwise. Non-tensor values come from the checkpoint's JSON; nothing is
unpickled.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint._dtensor import DTensor, local_region
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.discovery import newest_alternative
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

__all__ = ["LoadedCheckpoint", "ShardReader", "load_checkpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns."""

    path: Path
    """The checkpoint directory that was loaded."""
    state: Any
    """The saved nested state: template tensors filled in place, other tensors as new CPU tensors."""
    rank_state: Any
    """The ``rank_state`` saved by rank :attr:`saved_rank` (``None`` if it saved none)."""
    saved_rank: int
    """This rank modulo the saved world size: whose ``rank_state`` this is."""
    metadata: dict[str, Any]
    """The run metadata: ``format_version``, ``step``, ``world_size``, ``size_bytes`` and what the writer added."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


class ShardReader:
    """Reads and checks the shards of one checkpoint; used by :func:`load_checkpoint` and ``verify``."""

    def __init__(self, path: Path, document: dict[str, Any], storage: SnapshotStorage, *, verify_checksums: bool):
        self.path = path
        self.document = document
        self.verify_checksums = verify_checksums
        try:
            self.reader = storage.reader(path)
        except Exception as e:  # noqa: BLE001 - torchsnapshot reports a missing manifest as RuntimeError
            raise CorruptCheckpointError(f"checkpoint {path}: torchsnapshot metadata unreadable ({e})") from e
        unsafe = self.reader.unsafe_entries()
        if unsafe:
            raise UnsafeCheckpointError(
                f"checkpoint {path} holds pickled payloads, which lightning-ft never loads: {', '.join(unsafe)}"
            )

    def read_shard(self, key: str, record: dict[str, Any], shard: dict[str, Any]) -> torch.Tensor:
        """One stored shard of tensor ``key`` as a CPU tensor of the shard's shape, checksum checked."""
        rank, name = shard["rank"], shard["entry"]
        files = self.reader.files(rank, name)
        where = f"tensor {key!r} (entry {rank}/{name}, file {', '.join(files) or 'absent from the manifest'})"
        if not files:
            raise CorruptCheckpointError(f"checkpoint {self.path}: missing shard of {where}")
        out = torch.empty(shard["nbytes"], dtype=torch.uint8)
        try:
            self.reader.read(rank, name, out)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"checkpoint {self.path}: missing shard file of {where}") from e
        except Exception as e:  # noqa: BLE001 - torchsnapshot wraps short reads in various errors
            raise CorruptCheckpointError(f"checkpoint {self.path}: unreadable shard of {where}: {e}") from e
        if self.verify_checksums and zlib.crc32(out.numpy()) != shard["crc32"]:
            raise CorruptCheckpointError(f"checkpoint {self.path}: checksum mismatch in shard of {where}")
        return out.view(_dtype(record["dtype"])).reshape(shard["shape"])

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


def _template_tensors(obj: Any, path: str = "", out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    # Paths are built exactly as json_codec builds them, so a template tensor meets its saved reference.
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _template_tensors(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _template_tensors(v, f"{path}/{i}" if path else str(i), out)
    elif isinstance(obj, Namespace):
        _template_tensors(vars(obj), path, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _template_tensors({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, path, out)
    return out


def _fill(reader: ShardReader, key: str, path: str, target: torch.Tensor | None) -> torch.Tensor:
    record = reader.document["tensors"].get(key)
    if record is None:
        raise CorruptCheckpointError(f"checkpoint {reader.path}: tensor {key!r} is missing from the index")
    global_shape = record["global_shape"]
    if target is None:
        return reader.assemble(key, [0] * len(global_shape), global_shape)
    if list(target.shape) != global_shape:
        raise CheckpointError(
            f"checkpoint {reader.path}: tensor {path!r} has shape {global_shape} in the checkpoint but "
            f"{list(target.shape)} in the state to load into"
        )
    if isinstance(target, DTensor):
        if target.device_mesh.get_coordinate() is None:
            return target
        shape, offset = local_region(target.shape, target.device_mesh, target.placements)
        with torch.no_grad():
            target.to_local().copy_(reader.assemble(key, offset, shape))
        return target
    with torch.no_grad():
        target.copy_(reader.assemble(key, [0] * len(global_shape), global_shape))
    return target


def _agree(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank failed, so all ranks fall back together."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            raise CheckpointError(f"loading failed on rank {rank}: {message}")


def load_checkpoint(
    path: str | os.PathLike,
    state: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    verify_checksums: bool = True,
    storage: SnapshotStorage | None = None,
) -> LoadedCheckpoint:
    """Load committed checkpoint ``path``, filling the tensors of the template ``state`` in place.

    Collective over ``group`` (default: the default group) when torch.distributed is initialized: every rank calls,
    and if any rank fails, every rank raises. Do not call it while an :class:`AsyncCheckpointer` save on the same group is
    in flight.

    Raises:
        UncommittedCheckpointError: ``path`` does not exist or has no commit marker.
        FormatVersionError: unknown format version.
        UnsafeCheckpointError: the checkpoint holds pickled payloads.
        CorruptCheckpointError: a shard is missing or fails its checksum (the tensor key and file are named).
        CheckpointError: the template does not match (shape), or another rank failed.
    """
    path = Path(path)
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    error: BaseException | None = None
    loaded = None
    try:
        if not path.is_dir():
            raise UncommittedCheckpointError(f"checkpoint {path} does not exist")
        document = read_document(path)
        reader = ShardReader(path, document, storage or SnapshotStorage(), verify_checksums=verify_checksums)
        templates = _template_tensors(state) if state is not None else {}
        state_out = json_codec.decode(
            document["state"], lambda key, p: _fill(reader, key, p, templates.get(p) if p in templates else None)
        )
        metadata = json_codec.decode(document["metadata"])
        rank_states = document["rank_states"]
        saved_rank = rank % len(rank_states)
        rank_state = json_codec.decode(rank_states[saved_rank], lambda key, p: _fill(reader, key, p, None))
        loaded = LoadedCheckpoint(
            path=path, state=state_out, rank_state=rank_state, saved_rank=saved_rank, metadata=metadata
        )
    except CheckpointError as e:
        error = type(e)(f"{e}{newest_alternative(path)}")
        error.__cause__ = e.__cause__
    except Exception as e:  # noqa: BLE001 - still agree with the other ranks before raising
        error = e
    _agree(error, group)
    assert loaded is not None
    return loaded
