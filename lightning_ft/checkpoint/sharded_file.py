"""One ``torch.save`` file of full tensors, written by every rank from its own shards: DTensor state as one file.

A DTensor whose every local shard is one contiguous byte range of the full tensor's row-major bytes (placements
``Replicate`` and ``Shard(0)``, with torch's chunking, even or uneven; ``Shard(d)`` where every dimension before ``d``
has size 1) can be saved as the file a single process would write for the same model: Lightning's checkpoint dict
with every DTensor replaced by its full tensor. No rank ever holds a full tensor. The layout of the zip follows from
the record names and sizes alone (:mod:`~lightning_ft.checkpoint.parallel_file`), so every rank pickles the same dict
whose full tensors are *placeholders* (allocated, never touched: no memory is used for them), lays out the same file,
and ``pwrite`` s the bytes of the regions it owns (:func:`~lightning_ft.checkpoint.ownership.regions_to_write`: each
distinct region once, by one of the ranks holding it; replicas split) at their offsets in the full tensor's storage
record (the whole pages through ``O_DIRECT`` where allowed). Rank 0 combines the CRC32s the regions had when they
were staged into the content checksums lightning-ft records (before the pickle is made), and those of the ranks'
writes into each record's CRC (:func:`~lightning_ft.checkpoint.checksum.crc32_combine`), then writes the pickle, every
header and the directory. Bytes written per rank: its share of the distinct regions.

The result loads with ``torch.load(weights_only=True)``, ``pl_load`` and ``load_from_checkpoint`` in a process that
never imported lightning-ft, as full tensors. A resume at the same layout reads, on each rank, the slice of each full
tensor its DTensor holds (:func:`~lightning_ft.checkpoint.load.load_checkpoint`, memory-mapped).

What stays a folder (:func:`file_refusal` names the first tensor and its placement): a DTensor sharded on a dimension
after the first non-trivial one (``RowwiseParallel``'s ``nn.Linear`` weight is ``Shard(1)``: each rank holds a column
block, one byte range per row), ``_StridedShard`` (FSDP2 over tensor parallel), ``Partial``, and pipeline stages (each
stage's state is kept by its data-parallel replica 0 in its rank state; see docs/checkpointing.md, "Sharded state").
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_ft._compat import DTensor, Replicate, Shard, StridedShard
from lightning_ft.checkpoint import parallel_file
from lightning_ft.checkpoint.checksum import crc32, crc32_combine
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.single_file import checkpoint_dict
from lightning_ft.checkpoint.snapshot_storage import fsync_dir

__all__ = ["file_refusal", "holds_dtensors", "placement_is_contiguous", "write_sharded_file"]

_FULL = "full:"
"""Entry-name prefix of a full tensor's placeholder in the file's document."""


def _describe(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def placement_is_contiguous(placements: Sequence[Any], global_shape: Sequence[int]) -> bool:
    """Whether every local shard of a DTensor with ``placements`` and ``global_shape`` is one contiguous byte range of
    the full tensor's row-major bytes: every placement is ``Replicate`` or ``Shard(d)`` (not ``_StridedShard``) and
    every dimension before the last sharded one has size 1 (so a rank's box is a run of whole rows of that dimension).
    Pure; the same answer on every rank."""
    sharded: list[int] = []
    for placement in placements:
        if isinstance(placement, StridedShard):
            return False
        if isinstance(placement, Shard):
            sharded.append(placement.dim % max(len(global_shape), 1))
        elif not isinstance(placement, Replicate):
            return False  # Partial: unreduced values
    if not sharded:
        return True
    return all(size == 1 for size in list(global_shape)[: max(sharded)])


def file_refusal(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """``None`` when a checkpoint file can hold every tensor of ``named_tensors`` (plain tensors, and DTensors whose
    shards are contiguous byte ranges: :func:`placement_is_contiguous`); else one clause naming the first DTensor
    that cannot be held and its placements. Reads shapes and placements only (a module on the meta device is fine)."""
    for name, tensor in named_tensors:
        if isinstance(tensor, DTensor) and not placement_is_contiguous(tensor.placements, tensor.shape):
            return (
                f"{name!r} is a DTensor with placements {_describe(tensor.placements)} (shape {list(tensor.shape)}),"
                " whose local shards are not contiguous byte ranges of the full tensor (a checkpoint file holds"
                " Replicate and Shard(0) state)"
            )
    return None


def holds_dtensors(index: dict[str, dict[str, Any]]) -> bool:
    """Whether a save's tensor index (``Capture.tensors``) records a DTensor."""
    return any(record.get("kind") == "dtensor" for record in index.values())


def _byte_range(record: dict[str, Any], offset: Sequence[int], shape: Sequence[int], key: str) -> tuple[int, int]:
    """``(start, length)`` in bytes of the box ``offset``/``shape`` inside the full tensor of index ``record``.

    Raises:
        CheckpointError: the box is not one contiguous byte range.
    """
    global_shape = list(record["global_shape"])
    itemsize = torch.empty(0, dtype=getattr(torch, record["dtype"])).element_size()
    numel = math.prod(shape)
    first_partial = next((i for i, (a, b) in enumerate(zip(shape, global_shape, strict=True)) if a != b), None)
    contiguous = (
        numel == 0
        or first_partial is None
        or (
            all(shape[i] == 1 for i in range(first_partial))
            and all(shape[i] == global_shape[i] for i in range(first_partial + 1, len(shape)))
        )
    )
    if not contiguous:
        placements = record.get("placements")
        raise CheckpointError(
            f"tensor {key!r} (placements {placements}, shape {global_shape}): a local shard at offset {list(offset)}"
            f" of shape {list(shape)} is not a contiguous byte range of the full tensor, so it cannot be written into"
            " a checkpoint file; checkpoint_format='torchsnapshot' writes any placement"
        )
    start = 0
    stride = 1
    for dim in reversed(range(len(global_shape))):
        start += offset[dim] * stride
        stride *= global_shape[dim]
    return start * itemsize, numel * itemsize


def _full_crcs(
    index: dict[str, dict[str, Any]], regions: list[dict[str, Any]]
) -> dict[str, tuple[int, list[tuple[int, int, int, int, str]]]]:
    """Each shared tensor's full CRC32 and its pieces ``(start, length, crc, rank, entry)``, from every rank's staged
    regions, which must cover each tensor's bytes exactly once.

    Raises:
        CheckpointError: a region is not contiguous, or the regions leave a gap or overlap.
    """
    pieces: dict[str, list[tuple[int, int, int, int, str]]] = {}
    for region in regions:
        key = region["key"]
        start, length = _byte_range(index[key], region["offset"], region["shape"], key)
        if length:
            pieces.setdefault(key, []).append((start, length, region["crc32"], region["rank"], region["entry"]))
    out: dict[str, tuple[int, list[tuple[int, int, int, int, str]]]] = {}
    for key, record in index.items():
        if key.startswith("rank_state/"):
            continue
        total = math.prod(record["global_shape"]) * torch.empty(0, dtype=getattr(torch, record["dtype"])).element_size()
        crc, end = 0, 0
        ordered = sorted(pieces.get(key, []))
        for start, length, piece_crc, _, _ in ordered:
            if start != end:
                raise CheckpointError(
                    f"tensor {key!r}: the ranks' shards do not tile the full tensor (bytes {end}..{start} are"
                    f" {'missing' if start > end else 'written twice'}); it cannot be written into a checkpoint file"
                )
            crc = crc32_combine(crc, piece_crc, length)
            end = start + length
        if end != total:
            raise CheckpointError(f"tensor {key!r}: the ranks' shards cover {end} of its {total} bytes")
        out[key] = (crc, ordered)
    return out


def _file_document(
    document: dict[str, Any], full: dict[str, tuple[int, list[Any]]]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``document`` with each shared tensor stored as one whole shard (a placeholder entry of its full size, with its
    full CRC), as :func:`~lightning_ft.checkpoint.single_file.checkpoint_dict` builds a file from; and the
    placeholders (``torch.empty``: virtual memory, never touched, never written from)."""
    tensors = dict(document["tensors"])
    placeholders: dict[str, torch.Tensor] = {}
    for key, (crc, pieces) in full.items():
        record = tensors[key]
        nbytes = sum(length for _, length, _, _, _ in pieces)
        if nbytes == 0:
            tensors[key] = {**record, "shards": []}
            continue
        entry = f"{_FULL}{key}"
        placeholders[entry] = torch.empty(nbytes, dtype=torch.uint8)
        shard = {
            "rank": 0,
            "entry": entry,
            "offset": [0] * len(record["global_shape"]),
            "shape": list(record["global_shape"]),
            "nbytes": nbytes,
            "crc32": crc,
        }
        tensors[key] = {**record, "shards": [shard]}
    return {**document, "tensors": tensors}, placeholders


def rank_payload(job: Any, rank: int) -> tuple[tuple[Any, ...], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """This rank's part of a file save's first exchange (here and in
    :func:`~lightning_ft.checkpoint.file_commit.write_parallel_file`): ``(head, shared, entries)``, ``head`` being its
    own state (records renamed ``r<rank>.<entry>``, their tensors cloned, its ``rank_state/`` tensors, its JSON),
    ``shared`` the records of the replicated or sharded state, ``entries`` every staged tensor by entry name."""
    entries, records = job.capture.entries_and_records(rank)
    own = [r for r in records if r["key"].startswith("rank_state/")]
    shared = [r for r in records if not r["key"].startswith("rank_state/")]
    head = (
        [{**r, "entry": f"r{rank}.{r['entry']}"} for r in own],
        {f"r{rank}.{r['entry']}": entries[r["entry"]].clone() for r in own},
        {k: v for k, v in job.capture.tensors.items() if k.startswith("rank_state/")},
        job.capture.rank_state_json,
    )
    return head, shared, entries


def write_sharded_file(
    job: Any,
    target: Path,
    *,
    rank: int,
    agree: Callable[..., list[Any]],
    document_of: Callable[[list[Any]], tuple[dict[str, Any], int]],
) -> int:
    """Write the staged checkpoint file ``target`` of a save of DTensor state: Lightning's dict with full tensors,
    each rank writing the regions it staged (:func:`~lightning_ft.checkpoint.ownership.regions_to_write`, as for a
    folder); returns the tensor bytes of the save. Collective: every rank of the writer's group runs it for the same
    save ``job`` (the writer's ``_Job``), once rank 0 created ``target``'s staging folder
    (:func:`~lightning_ft.checkpoint.file_commit.write_parallel_file` runs it between its first step and the commit).

    1. One exchange gives every rank every rank's own state (RNG states, per-rank tensors; their bytes travel with
       it) and every rank's staged regions (key, offset, shape, crc32; not their bytes); every rank builds the same
       document (refused if the regions do not cover the state), the full tensors' CRCs and the same checkpoint dict,
       whose full tensors are untouched placeholders.
    2. Every rank lays out the file (:func:`~lightning_ft.checkpoint.parallel_file.plan_file`; the ranks' layouts
       compared) and writes its regions' bytes at their offsets in their full tensor's record; rank 0 also writes the
       records of the per-rank tensors. After one exchange of the pieces' CRCs rank 0 writes the pickle, headers and
       directory (:func:`~lightning_ft.checkpoint.parallel_file.finish_file`) and fsyncs the file and its folder.
       Every step ends with ``agree``: a failure on any rank fails the save on every rank.
    """
    # 1. Every rank's own state and its regions' records to every rank; the same document and dict everywhere.
    error, payload = None, None
    entries: dict[str, torch.Tensor] = {}
    try:
        head, shared, entries = rank_payload(job, rank)
        payload = (*head, shared)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    gathered = agree(error, payload)
    error, checkpoint, full = None, None, {}
    try:
        file_entries: dict[str, torch.Tensor] = {}
        for _, their_entries, _, _, _ in gathered:
            file_entries.update(their_entries)
        shared_index = {k: v for k, v in job.capture.tensors.items() if not k.startswith("rank_state/")}
        per_rank = [
            (their_own + their_shared, {**tensors, **(shared_index if r == 0 else {})}, rank_json)
            for r, (their_own, _, tensors, rank_json, their_shared) in enumerate(gathered)
        ]
        document, size_bytes = document_of(per_rank)
        full = _full_crcs(shared_index, [r for *_, their_shared in gathered for r in their_shared])
        file_document, placeholders = _file_document(document, full)
        checkpoint = checkpoint_dict(file_document, {**file_entries, **placeholders})
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    agree(error)

    # 2. The layout, the same on every rank; each rank writes its regions; rank 0 the rest.
    error, plan, mine = None, None, None
    try:
        plan = parallel_file.plan_file(checkpoint, target)
        data_pkl = plan.payloads["data.pkl"]
        by_pointer = {
            tensor.untyped_storage().data_ptr(): name
            for name, tensor in placeholders.items()  # the placeholders' storages are those of the dict's tensors
        }
        position = {record.name: index for index, record in enumerate(plan.layout.records)}
        record_of = {
            by_pointer.get(storage.data_ptr(), name): position[name] for name, storage in plan.storages.items()
        }
        sizes = [(r.name, r.size) for r in plan.layout.records if r.name.startswith("data/")]
        mine = (hashlib.sha256(repr(sizes).encode()).hexdigest(), len(data_pkl))
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    layouts = agree(error, mine)
    error, pieces = None, []
    try:
        if any(layout[0] != layouts[0][0] for layout in layouts):
            raise CheckpointError(
                f"cannot save {job.path} as one file: the ranks' checkpoint dicts differ in their tensors' sizes;"
                " every rank must pass the same state structure"
            )
        assert plan is not None
        if rank != 0 and layouts[0][1] != mine[1]:  # rank 0's pickle is written (its marker's time differs)
            plan = parallel_file.plan_file(checkpoint, target, data_pkl_size=layouts[0][1])
        fd = os.open(os.fspath(target), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if rank == 0:
                os.ftruncate(fd, plan.layout.size)  # only ever cuts beyond the planned size, which nobody writes
            ranges, mine_pieces = [], []
            for key, (_, key_pieces) in full.items():
                index = record_of[f"{_FULL}{key}"]
                record = plan.layout.records[index]
                for start, length, _, owner, entry in key_pieces:
                    if owner == rank:
                        ranges.append((memoryview(entries[entry].numpy()).cast("B"), record.data_offset + start))
                        mine_pieces.append((index, start, length))
            crcs = parallel_file.write_ranges(fd, target, ranges)
            pieces += [(*piece, crc) for piece, crc in zip(mine_pieces, crcs, strict=True)]
            if rank == 0:  # the per-rank tensors' records (every rank holds them; small): rank 0 writes them whole
                for name, index in record_of.items():
                    if name.startswith(_FULL):
                        continue
                    record = plan.layout.records[index]
                    view = parallel_file._storage_bytes(plan.storages[record.name])
                    parallel_file._pwrite_all(fd, view, record.data_offset)
                    pieces.append((index, 0, view.nbytes, crc32(view) if view.nbytes else 0))
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    everyone = agree(error, pieces)
    error = None
    if rank == 0:
        try:
            assert plan is not None
            by_record: dict[int, list[tuple[int, int, int]]] = {}
            for their_pieces in everyone:
                for index, start, length, piece_crc in their_pieces:
                    by_record.setdefault(index, []).append((start, length, piece_crc))
            crcs = {
                index: parallel_file.combine_pieces(plan.layout, items, index) for index, items in by_record.items()
            }
            fd = os.open(os.fspath(target), os.O_WRONLY)
            try:
                parallel_file.finish_file(fd, plan, crcs, data_pkl=data_pkl)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(target.parent)
        except BaseException as e:  # noqa: BLE001 - the other ranks wait for this outcome
            error = e
    agree(error)
    return size_bytes
