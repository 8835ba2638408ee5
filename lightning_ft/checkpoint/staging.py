"""Synchronous capture of the state to checkpoint: the part of a save that blocks the training loop.

:class:`Stager` walks the nested state once, encodes everything that is not a tensor to JSON (so later mutation of dicts
and lists cannot leak into the checkpoint) and copies every tensor this rank has to write into a staging buffer it owns:
a pinned CPU buffer with a non-blocking copy for CUDA tensors, a plain CPU buffer for CPU tensors. Buffers are reused
from one save to the next (at most one save is in flight, so the previous write has finished with them).

Ownership decides who writes what, without communication, because every rank sees the same state: a plain tensor is a
replica and is written by exactly one rank, assigned greedily by size so the bytes spread over ranks; a DTensor's local
shard is written by one rank among those holding an identical shard (the replicas along ``Replicate`` mesh dimensions),
picked by a hash of the key. DTensors are never handed to torchsnapshot: each shard becomes a plain tensor with its
global shape and offset recorded in our own index (``_StridedShard`` included).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint._dtensor import DTensor, Replicate, describe_placements, local_region


@dataclass
class StagedShard:
    """One tensor entry this rank writes: a contiguous copy of (a region of) one logical tensor."""

    key: str
    """The logical tensor's key in the checkpoint index."""
    name: str
    """The flat storage entry name (``t<n>``), unique within this rank."""
    data: torch.Tensor
    """The staged CPU copy, contiguous, shaped like the region."""
    offset: list[int]
    """Global offset of the region (all zeros for a plain tensor)."""


@dataclass
class Capture:
    """Everything one save needs after :meth:`Stager.capture` returns; nothing in it aliases the caller's state."""

    state_json: Any
    rank_state_json: Any
    tensors: dict[str, dict[str, Any]]
    """Index records (dtype, global shape, kind, placements) for every logical tensor this rank knows."""
    shards: list[StagedShard] = field(default_factory=list)
    cuda_devices: set[int] = field(default_factory=set)


def _unique_key(path: str, seen: set[str], prefix: str) -> str:
    key = f"{prefix}{path}" if path else f"{prefix}<root>"
    base, n = key, 1
    while key in seen:
        n += 1
        key = f"{base}#{n}"
    seen.add(key)
    return key


def _tensor_record(tensor: torch.Tensor) -> dict[str, Any]:
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        return {
            "kind": "dtensor",
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "global_shape": list(tensor.shape),
            "placements": describe_placements(tensor.placements),
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        }
    return {"kind": "tensor", "dtype": str(tensor.dtype).removeprefix("torch."), "global_shape": list(tensor.shape)}


def _dtensor_is_owned(tensor: DTensor, key: str) -> bool:
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    replica_index, num_replicas = 0, 1
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            replica_index = replica_index * tensor.device_mesh.size(dim) + coordinate[dim]
            num_replicas *= tensor.device_mesh.size(dim)
    # Partial placements hold unreduced values; the caller must reduce them first (they never occur in state dicts).
    return replica_index == zlib.crc32(key.encode()) % num_replicas


def assign_replicas(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Deterministic greedy assignment of replicated tensors to ranks, largest first, to the least-loaded rank."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


class Stager:
    """Captures state into reusable staging buffers. Not thread-safe: one caller, one capture at a time.

    Example::

        stager = Stager()
        capture = stager.capture({"w": torch.ones(3)}, None, rank=0, world_size=1)
    """

    def __init__(self, *, reuse_buffers: bool = True) -> None:
        self._reuse = reuse_buffers
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer_for(self, key: str, source: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            pin = source.is_cuda and torch.cuda.is_available()
            buf = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)
            if self._reuse:
                self._buffers[key] = buf
        return buf

    def capture(self, state: Any, rank_state: Any, *, rank: int, world_size: int) -> Capture:
        """Encode ``state`` and ``rank_state`` and copy the tensors this rank writes. Blocks until the copies are done."""
        seen: set[str] = set()
        found: list[tuple[str, torch.Tensor]] = []
        rank_found: list[tuple[str, torch.Tensor]] = []

        def on_state_tensor(tensor: torch.Tensor, path: str) -> str:
            key = _unique_key(path, seen, "")
            found.append((key, tensor))
            return key

        def on_rank_tensor(tensor: torch.Tensor, path: str) -> str:
            key = _unique_key(path, seen, f"rank_state/{rank}/")
            rank_found.append((key, tensor))
            return key

        state_json = json_codec.encode(state, on_state_tensor)
        rank_state_json = json_codec.encode(rank_state, on_rank_tensor) if rank_state is not None else None

        capture = Capture(state_json=state_json, rank_state_json=rank_state_json, tensors={})
        replicas = {k: t.numel() * t.element_size() for k, t in found if not isinstance(t, DTensor)}
        owners = assign_replicas(replicas, world_size)
        to_copy: list[tuple[str, torch.Tensor, list[int]]] = []
        for key, tensor in found:
            capture.tensors[key] = _tensor_record(tensor)
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                if _dtensor_is_owned(tensor, key):
                    _, offset = local_region(tensor.shape, tensor.device_mesh, tensor.placements)
                    to_copy.append((key, local, list(offset)))
            elif owners[key] == rank:
                to_copy.append((key, tensor, [0] * tensor.dim()))
        for key, tensor in rank_found:
            if isinstance(tensor, DTensor):
                raise TypeError(f"rank_state/{key}: rank_state holds per-rank values; a DTensor belongs in state")
            capture.tensors[key] = _tensor_record(tensor)
            to_copy.append((key, tensor, [0] * tensor.dim()))

        for n, (key, tensor, offset) in enumerate(to_copy):
            source = tensor.detach()
            if source.numel() == 0:
                continue  # nothing to write; the index record still carries the shape
            buf = self._buffer_for(key, source)
            buf.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                capture.cuda_devices.add(source.device.index or 0)
            capture.shards.append(StagedShard(key=key, name=f"t{n}", data=buf, offset=offset))
        for device in capture.cuda_devices:
            # The copies above are asynchronous; the caller may mutate the source as soon as we return.
            torch.cuda.synchronize(device)
        return capture
