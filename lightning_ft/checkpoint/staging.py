"""Synchronous capture of the state to checkpoint: the part of a save that blocks the training loop.

A capture has two steps, with the ownership decision between them (:meth:`AsyncCheckpointer.save` runs all three):

1. :func:`encode_state` walks the nested state once and encodes everything that is not a tensor to JSON, so later
   mutation of dicts and lists cannot leak into the checkpoint. It lists the tensors of the shared state and of the
   per-rank state and builds their index records (dtype, global shape, DTensor placements and mesh).
2. :meth:`Stager.capture` copies what this rank writes, the regions chosen by
   :func:`~lightning_ft.checkpoint.ownership.regions_to_write` plus every per-rank tensor, into staging buffers it
   owns, before it returns: a pinned CPU buffer with a non-blocking copy for CUDA tensors (then a synchronize), a
   page-aligned CPU buffer for CPU tensors. Buffers are reused from one save to the next (at most one save is in
   flight, so the previous write has finished with them); a buffer this capture does not use is released. For a
   checkpoint file that every rank writes its share of (``shares``, :func:`file_shares`), each rank copies only the
   byte range of each replicated tensor it writes, into a buffer of the tensor's size (the pickle needs the storage's
   size) of which only that range's pages are ever touched, and takes the crc32 of a sample of every replicated tensor
   (:func:`sample_crc`, how the ranks check that their replicas agree), both before returning.

Every byte a save writes is copied before the save call returns. That is what makes a checkpoint the state at its
save call whatever user code does next (in place, under ``no_grad``, through ``.data``, by assigning a new tensor,
loading another state): nothing after the call can reach the copy. An earlier design deferred the copy of parameters
and optimizer state until the next optimizer step; user hooks between the save and that step (an EMA swap at
``on_validation_start``, clipping in ``on_train_batch_end``, Lightning's SWA) either mixed two states into one
checkpoint or failed the save, so it was removed (docs/checkpointing.md, "Consistency").

DTensors are never handed to torchsnapshot: each owned local shard becomes a plain tensor with its global offset
recorded in our own index (``_StridedShard`` included). A sparse tensor is stored as its dense parts
(:mod:`~lightning_ft.checkpoint.json_codec`); a tensor that holds no plain bytes (quantized, nested, on the meta device)
is refused by :func:`encode_state`, naming its key, before anything is copied.
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_ft._compat import DTensor
from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.checksum import crc32
from lightning_ft.checkpoint.direct_write import aligned_empty
from lightning_ft.checkpoint.dtensor_geometry import describe_placements
from lightning_ft.checkpoint.ownership import Region

__all__ = [
    "Capture",
    "EncodedState",
    "StagedShard",
    "Stager",
    "encode_state",
    "file_shares",
    "holds_bitwise",
    "sample_crc",
    "stage_rank_zeros_copies",
]


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
    staged: tuple[int, int] | None = None
    """The bytes ``[start, end)`` of ``data`` that hold the copy, where this rank staged only the part of a replicated
    tensor it writes into a checkpoint file (:func:`file_shares`): the rest of ``data`` is unbacked memory, never
    read. ``None``: all of it."""


@dataclass
class EncodedState:
    """The state and the per-rank state with every non-tensor value encoded to JSON, and their tensors listed."""

    state_json: Any
    rank_state_json: Any
    tensors: dict[str, dict[str, Any]]
    """Index records (dtype, global shape, kind, placements) for every logical tensor this rank knows."""
    shared: list[tuple[str, torch.Tensor]]
    """``(key, tensor)`` of the shared state's tensors (the caller's tensors, not copies)."""
    per_rank: list[tuple[str, torch.Tensor]]
    """``(key, tensor)`` of the per-rank state's tensors, written by this rank alone."""


@dataclass
class Capture:
    """Everything one save needs after :meth:`Stager.capture` returns; nothing in it aliases the caller's state."""

    state_json: Any
    rank_state_json: Any
    tensors: dict[str, dict[str, Any]]
    """Index records (dtype, global shape, kind, placements) for every logical tensor this rank knows."""
    shards: list[StagedShard] = field(default_factory=list)
    """The copies of everything this rank writes."""
    shares: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """For a checkpoint file written by every rank: each replicated tensor's ``(rank, start, end)`` byte ranges (who
    writes which bytes), by entry name (:func:`file_shares`); empty otherwise."""
    samples: dict[str, int] = field(default_factory=dict)
    """With ``shares``: the crc32 of a sample of each replicated tensor's bytes at the capture, by key
    (:func:`sample_crc`): what the ranks compare to agree that their replicas are equal, since none of them staged
    every byte."""

    @property
    def nbytes(self) -> int:
        """Bytes staged by this capture (the bytes this rank writes)."""
        return sum(_staged_bytes(s) for s in self.shards)

    def entries_and_records(self, rank: int = 0) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """The staged shards as rank ``rank`` writes them: flat ``uint8`` views by entry name, and their index
        records (each with its entry's crc32). Reads the staged copies only."""
        entries: dict[str, torch.Tensor] = {}
        records: list[dict[str, Any]] = []
        for shard in self.shards:
            data = shard.data.reshape(-1).view(torch.uint8)
            entries[shard.name] = data
            records.append(
                {
                    "key": shard.key,
                    "rank": rank,
                    "entry": shard.name,
                    "offset": shard.offset,
                    "shape": list(shard.data.shape),
                    "nbytes": data.numel(),
                    # A partly staged tensor's crc32 is known only once every rank has written its piece of the file.
                    "crc32": crc32(data.numpy()) if shard.staged is None else None,
                }
            )
        return entries, records


def _staged_bytes(shard: StagedShard) -> int:
    if shard.staged is not None:
        return shard.staged[1] - shard.staged[0]
    return shard.data.numel() * shard.data.element_size()


def file_shares(shared: Sequence[tuple[str, torch.Tensor]], world_size: int) -> dict[str, list[tuple[int, int, int]]]:
    """Who writes which bytes of each plain tensor of the replicated state ``shared`` into a checkpoint file written
    by ``world_size`` ranks: ``{key: [(rank, start, end), ...]}``
    (:func:`~lightning_ft.checkpoint.parallel_file.nominal_shares` over the tensors in the state's order: the same on
    every rank, known before anything is copied). Empty tensors and DTensors are left out."""
    from lightning_ft.checkpoint.parallel_file import nominal_shares

    plain = [(key, t) for key, t in shared if not isinstance(t, DTensor) and t.numel()]
    ranges = nominal_shares([t.numel() * t.element_size() for _, t in plain], world_size)
    return {key: r for (key, _), r in zip(plain, ranges, strict=True)}


SAMPLE_CHUNK_BYTES = 4096
SAMPLE_CHUNKS = 4
"""A replicated tensor's sample (:func:`sample_crc`): up to this many chunks of :data:`SAMPLE_CHUNK_BYTES`: the whole
tensor where it is at most that large (16 KiB), else its first and last chunk and two more at places that change from
one save to the next."""


def sample_crc(tensor: torch.Tensor, key: str, seed: int) -> int:
    """The crc32 of a sample of ``tensor``'s bytes (contiguous; CPU or accelerator): the whole of a tensor of at most
    16 KiB, else its first and last 4 KiB and two 4 KiB chunks at offsets drawn from ``key`` and ``seed`` (the same on
    every rank for the same save)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n <= SAMPLE_CHUNK_BYTES * SAMPLE_CHUNKS:
        starts = [0]
        size = n
    else:
        size = SAMPLE_CHUNK_BYTES
        span = n - size
        drawn = [zlib.crc32(f"{key}|{seed}|{k}".encode()) % (span + 1) for k in range(SAMPLE_CHUNKS - 2)]
        starts = [0, span, *drawn]
    parts = torch.cat([flat[a : a + size] for a in starts]) if len(starts) > 1 else flat[:size]
    if parts.device.type != "cpu":
        parts = parts.cpu()
    return crc32(parts.contiguous().numpy())


def _unbacked_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # A page-aligned anonymous mapping: memory is taken only for the pages written (the range a rank stages).
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


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


def _check_storable(tensor: torch.Tensor, path: str) -> None:
    if isinstance(tensor, DTensor):
        return
    what = path or "<root>"
    if tensor.is_quantized:
        raise TypeError(
            f"{what}: a quantized tensor cannot be checkpointed; save its int_repr() and quantization parameters"
        )
    if tensor.is_nested:
        raise TypeError(f"{what}: a nested tensor cannot be checkpointed; save its components (unbind()) instead")
    if tensor.is_meta:
        raise TypeError(f"{what}: a tensor on the meta device holds no data; materialize it before saving")


def encode_state(state: Any, rank_state: Any, *, rank: int) -> EncodedState:
    """Encode ``state`` and ``rank_state`` (``None``: none) to JSON and list their tensors; copies no tensor data.

    Per-rank tensors get keys under ``rank_state/<rank>/``, so every rank's keys are distinct.

    Raises:
        TypeError: ``rank_state`` holds a DTensor, a DTensor has a placement that cannot be checkpointed, or a tensor
            holds no plain bytes (quantized, nested, meta, or a layout other than dense and sparse); the message
            names its key.
    """
    seen: set[str] = set()
    shared: list[tuple[str, torch.Tensor]] = []
    per_rank: list[tuple[str, torch.Tensor]] = []

    def on_state_tensor(tensor: torch.Tensor, path: str) -> str:
        _check_storable(tensor, path)
        key = _unique_key(path, seen, "")
        shared.append((key, tensor))
        return key

    def on_rank_tensor(tensor: torch.Tensor, path: str) -> str:
        _check_storable(tensor, path)
        key = _unique_key(path, seen, f"rank_state/{rank}/")
        per_rank.append((key, tensor))
        return key

    state_json = json_codec.encode(state, on_state_tensor)
    rank_state_json = json_codec.encode(rank_state, on_rank_tensor) if rank_state is not None else None
    for key, tensor in per_rank:
        if isinstance(tensor, DTensor):
            raise TypeError(f"{key}: rank_state holds per-rank values; a DTensor belongs in state")
    tensors = {key: _tensor_record(tensor) for key, tensor in (*shared, *per_rank)}
    return EncodedState(state_json, rank_state_json, tensors, shared, per_rank)


class Stager:
    """Copies what this rank writes into reusable staging buffers. Not thread-safe: one caller, one capture at a time.

    Example::

        encoded = encode_state({"w": torch.ones(3)}, None, rank=0)
        writes = regions_to_write(encoded.shared, rank=0, world_size=1, group=None)
        capture = Stager().capture(encoded, writes)
    """

    def __init__(self, *, reuse_buffers: bool = True) -> None:
        self._reuse = reuse_buffers
        self._buffers: dict[str, torch.Tensor] = {}
        self._captures = 0

    def _buffer_for(self, key: str, source: torch.Tensor, *, partial: bool = False) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            if partial:  # the whole tensor's size for the pickle; memory only for the range written into it
                buf = _unbacked_empty(source.shape, source.dtype)
            elif source.is_cuda and torch.cuda.is_available():
                buf = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
            else:  # page-aligned: the writer sends it to the disk without the page cache, straight from here
                buf = aligned_empty(source.shape, source.dtype)
            if self._reuse:
                self._buffers[key] = buf
        return buf

    def capture(
        self,
        encoded: EncodedState,
        writes: Sequence[tuple[Region, torch.Tensor]],
        *,
        shares: dict[str, list[tuple[int, int, int]]] | None = None,
        rank: int = 0,
        group: Any = None,
    ) -> Capture:
        """Copy ``writes`` (regions of the shared state with their local values) and every per-rank tensor.

        ``shares`` (:func:`file_shares`; a checkpoint file written by every rank): of each tensor it names, only the
        bytes ``rank`` writes (:func:`~lightning_ft.checkpoint.parallel_file.staged_range`) are copied, into a buffer
        of the tensor's size whose other pages are never touched, and a sample of its bytes is checksummed
        (:attr:`Capture.samples`), both before returning. With ``shares`` and the writer's process ``group``
        (collective then): where a tensor's sample differs from rank 0's, rank 0 stages the whole of it
        (:func:`stage_rank_zeros_copies`).

        Blocks until every copy is done (CUDA copies included); from the return on, the caller may mutate every tensor
        it passed.
        """
        from lightning_ft.checkpoint.parallel_file import staged_range

        shares = shares or {}
        to_copy = [(region.key, value, list(region.offset)) for region, value in writes]
        to_copy += [(key, tensor, [0] * tensor.dim()) for key, tensor in encoded.per_rank]
        capture = Capture(
            state_json=encoded.state_json, rank_state_json=encoded.rank_state_json, tensors=encoded.tensors
        )
        self._captures += 1
        cuda_devices: set[int] = set()
        for n, (key, tensor, offset) in enumerate(to_copy):
            source = tensor.detach()
            if source.numel() == 0:
                continue  # nothing to write; the index record still carries the shape
            ranges = shares.get(key)
            buf = self._buffer_for(key, source, partial=ranges is not None)
            shard = StagedShard(key=key, name=f"t{n}", data=buf, offset=offset)
            capture.shards.append(shard)
            if ranges is not None:
                capture.shares[shard.name] = ranges
                if source.is_contiguous():
                    size = source.element_size()
                    lo, hi = staged_range(ranges, rank)
                    first, last = lo // size, -(-hi // size)
                    buf.view(-1)[first:last].copy_(source.reshape(-1)[first:last])  # blocking: pageable memory
                    shard.staged = (first * size, last * size)
                    capture.samples[key] = sample_crc(source, key, self._captures)
                else:  # rare (a transposed parameter): the whole copy, then the sample from it
                    buf.copy_(source)
                    capture.samples[key] = sample_crc(buf, key, self._captures)
                continue
            buf.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                cuda_devices.add(source.device.index or 0)
        for device in cuda_devices:
            # The copies above are asynchronous; the caller may mutate the source as soon as we return.
            torch.cuda.synchronize(device)
        if capture.shares and group is not None:
            stage_rank_zeros_copies(capture, encoded.shared, rank=rank, group=group)
        if self._reuse:
            # Ownership can move between saves; a buffer for a region this rank no longer writes is dead weight.
            used = {shard.key for shard in capture.shards}
            self._buffers = {key: buf for key, buf in self._buffers.items() if key in used}
        return capture


def stage_rank_zeros_copies(
    capture: Capture, shared: Sequence[tuple[str, torch.Tensor]], *, rank: int, group: Any
) -> None:
    """Collective, at the save call, after :meth:`Stager.capture` with ``shares``: compare every rank's
    :attr:`Capture.samples` with rank 0's; where a tensor's differs (a parameter DDP does not synchronize), rank 0
    stages the whole of it, so that the background writer can send rank 0's bytes of it to every rank and the file
    holds rank 0's copy, as ``DDPStrategy``'s checkpoint does
    (:func:`~lightning_ft.checkpoint.file_commit.write_parallel_file`). No rank read every byte, so a difference
    outside the sample is not detected (the file then holds each rank's range of its own replica)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, capture.samples, group=group)
    reference = gathered[0]
    differing = {k for theirs in gathered[1:] for k, crc in theirs.items() if reference.get(k) != crc}
    if rank != 0 or not differing:
        return
    sources = dict(shared)
    for shard in capture.shards:
        if shard.key in differing and shard.staged is not None:
            shard.data.copy_(sources[shard.key].detach())
            shard.staged = None


def holds_bitwise(capture: Capture, mine: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether ``capture`` staged, bitwise, every non-empty tensor of ``mine`` (``(key, value)`` pairs: what this rank
    writes now) and nothing else; where it staged only a share of a file's tensor, the bytes of that share. Reads the
    staged copies only."""
    staged = {shard.key: shard for shard in capture.shards}
    if {key for key, value in mine if value.numel() > 0} != set(staged):
        return False
    for key, value in mine:
        if value.numel() == 0:
            continue
        shard = staged[key]
        copy = shard.data
        if copy.dtype != value.dtype or copy.shape != value.shape:
            return False
        lo, hi = shard.staged if shard.staged is not None else (0, None)  # a share of a file: its bytes only
        # bytes: nan equals nan, -0.0 differs from 0.0
        if not torch.equal(_bytes_of(value)[lo:hi], _bytes_of(copy)[lo:hi]):
            return False
    return True


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
