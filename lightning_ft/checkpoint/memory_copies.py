"""The memory tier's copies on disk: one rank's full state in node-local memory, written, checked, listed, moved.

A memory copy is a lightning-ft checkpoint of one rank: the same index, per-shard crc32, coverage check, metadata file
and commit marker as a durable checkpoint (:mod:`~lightning_ft.checkpoint.commit`), written by that rank alone through
:class:`~lightning_ft.checkpoint.storage.memory_files.MemoryFileStorage` (no collective), from a capture taken at the
save call (:mod:`~lightning_ft.checkpoint.staging`: every tensor copied before the call returns). Each rank writes its
own full state, so that it can be restored alone, without any other rank's copy.

Layout, under ``<memory dir>/lightning-ft/<run_id>-<key>/`` (the run id and a digest of its checkpoint folders and
model: ``memory_run_name`` in :mod:`lightning_ft.strategy.memory_checkpoints`) and nowhere else (a folder of another
run is never read or deleted)::

    rank<r>/step=<N>/           rank r's own copy (this node)
    peer-of-rank<r>/step=<N>/   rank r's copy, kept here for its partner on another node

A copy is committed by renaming its finished folder (marker inside) from a hidden temporary name to ``step=<N>``; the
older step of the same rank is deleted only after that rename. :func:`pack` and :func:`unpack` turn a committed copy
into bytes and back, for the peer copy and for a restore from a partner.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft._compat import DTensor
from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.commit import COMMIT_MARKER, build_document, read_document, write_marker, write_metadata
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.load import LoadedCheckpoint, load_checkpoint
from lightning_ft.checkpoint.ownership import held_region
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.staging import Capture, Stager, encode_state
from lightning_ft.checkpoint.storage.memory_files import MemoryFileStorage

__all__ = [
    "MemoryCopy",
    "capture_own",
    "check_copy",
    "copy_folder",
    "list_copies",
    "load_copy",
    "pack",
    "remove_others",
    "run_folder",
    "unpack",
    "write_copy",
]

_LANE = re.compile(r"(rank|peer-of-rank)(\d+)")
_STEP = re.compile(r"step=(\d+)")
_HEADER = struct.Struct("<Q")


def run_folder(root: Path, run_id: str) -> Path:
    """The folder of run ``run_id`` under the memory directory ``root``: the only place the tier reads or deletes."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise ValueError(f"run id {run_id!r} cannot name a folder")
    return Path(root) / "lightning-ft" / run_id


def copy_folder(run_dir: Path, *, rank: int, step: int, peer: bool) -> Path:
    """Where rank ``rank``'s copy of ``step`` lives: its own (``peer=False``) or the one a partner keeps for it."""
    return run_dir / f"{'peer-of-rank' if peer else 'rank'}{rank}" / f"step={step}"


@dataclass(frozen=True)
class MemoryCopy:
    """A committed copy found in a memory folder."""

    rank: int
    """The rank whose state it holds."""
    step: int
    """The step its folder is named after."""
    peer: bool
    """Whether it is a copy kept for a partner (``peer-of-rank<r>``) rather than the rank's own."""
    path: Path


def capture_own(state: dict[str, Any], rank_state: dict[str, Any], stager: Stager) -> Capture:
    """Copy all of ``state`` and ``rank_state`` (this rank's full state) into ``stager``'s buffers now.

    Local: no communication. From the return on, the caller may mutate every tensor it passed.

    Raises:
        TypeError: the state holds a DTensor (the memory tier keeps plain data-parallel state only), or a tensor that
            cannot be checkpointed (as :func:`~lightning_ft.checkpoint.staging.encode_state`).
    """
    encoded = encode_state(state, rank_state, rank=0)
    writes = []
    for key, tensor in encoded.shared:
        if isinstance(tensor, DTensor):
            raise TypeError(f"{key}: the memory tier keeps plain (data-parallel) state; this is a DTensor")
        held = held_region(key, tensor)
        if held is not None:
            writes.append(held)
    return stager.capture(encoded, writes)


def write_copy(folder: Path, capture: Capture, metadata: dict[str, Any], *, step: int) -> int:
    """Write ``capture`` as the committed copy ``folder`` (``.../step=<step>``); returns its tensor bytes.

    Not collective. The copy appears at ``folder`` only once complete (a rename of its finished temporary folder), and
    a copy already there (the same step saved again) is replaced only then.

    Raises:
        OSError: the folder is full or cannot be written (nothing is left at ``folder``; the previous copy stays).
        CheckpointError: the capture does not cover its own index (a bug, never expected).
    """
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        entries, records = capture.entries_and_records()
        MemoryFileStorage().write(tmp, entries)
        document, size_bytes = build_document(
            json_codec.encode(metadata, path="metadata"),
            step=step,
            world_size=1,
            state_json=capture.state_json,
            gathered=[(records, capture.tensors, capture.rank_state_json)],
            name=folder,
        )
        crc = write_metadata(tmp, document)
        full_state = metadata.get("full_state")
        write_marker(
            tmp, step=step, metadata_crc32=crc, full_state=full_state if isinstance(full_state, bool) else None
        )
        _commit_folder(tmp, folder)
    except BaseException:
        _remove(tmp)
        raise
    return size_bytes


def _commit_folder(tmp: Path, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        _remove(old)
        os.rename(folder, old)
        os.rename(tmp, folder)
        _remove(old)
    else:
        os.rename(tmp, folder)


def pack(folder: Path) -> bytes:
    """The files of the committed copy ``folder`` as one byte string (a header naming them, then their bytes)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    names = [str(p.relative_to(folder)) for p in files]
    blobs = [p.read_bytes() for p in files]
    header = json.dumps({"files": [[n, len(b)] for n, b in zip(names, blobs, strict=True)]}).encode()
    return b"".join([_HEADER.pack(len(header)), header, *blobs])


def unpack(data: bytes | memoryview, folder: Path) -> None:
    """Write the files :func:`pack` packed as the copy ``folder``; it appears there only once complete.

    Raises:
        OSError: the folder is full or cannot be written.
        CheckpointError: ``data`` is not what :func:`pack` produced.
    """
    view = memoryview(data)
    try:
        (length,) = _HEADER.unpack_from(view, 0)
        header = json.loads(bytes(view[_HEADER.size : _HEADER.size + length]))
        files = [(str(n), int(s)) for n, s in header["files"]]
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"memory copy for {folder}: the bytes received are not a packed copy ({e})") from e
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        offset = _HEADER.size + length
        for name, size in files:
            target = (tmp / name).resolve()
            if tmp.resolve() not in target.parents:
                raise CheckpointError(f"memory copy for {folder}: refusing the file name {name!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.write(view[offset : offset + size])
            offset += size
        _commit_folder(tmp, folder)
    except BaseException:
        _remove(tmp)
        raise


def list_copies(run_dir: Path, *, local_rank: int, local_world_size: int) -> list[MemoryCopy]:
    """Committed copies under ``run_dir`` in this rank's lane (ranks ``r`` with ``r % local_world_size ==
    local_rank``, the ones this local rank wrote or kept on this node), newest step first. Not collective."""
    found = []
    if not run_dir.is_dir():
        return found
    for lane in run_dir.iterdir():
        match = _LANE.fullmatch(lane.name)
        if match is None or not lane.is_dir() or int(match[2]) % local_world_size != local_rank:
            continue
        for child in lane.iterdir():
            step = _STEP.fullmatch(child.name)
            if step is not None and child.is_dir() and (child / COMMIT_MARKER).is_file():
                found.append(MemoryCopy(int(match[2]), int(step[1]), match[1] != "rank", child))
    return sorted(found, key=lambda c: (-c.step, c.peer, c.rank))


def check_copy(copy: MemoryCopy, expected: dict[str, Any], *, read_shards: bool = True) -> str | None:
    """Why ``copy`` cannot be restored, or ``None``: its marker and metadata (checksum), the index's coverage, the step
    (folder, marker and metadata agree), each of ``expected`` (run id, world size, mesh, node layout) against its
    metadata, and (``read_shards``) every shard's crc32. Not collective; with ``read_shards`` it reads the whole copy
    (without, the caller loads it next, which checks every shard's crc32 as it reads)."""
    path = copy.path
    try:
        document = read_document(path)
        marker = json.loads((path / COMMIT_MARKER).read_bytes())
        problems = coverage_problems(document)
        if problems:
            return f"memory copy {path}: {'; '.join(problems[:3])}"
        metadata = json_codec.decode(document["metadata"])
        steps = {copy.step, marker.get("step"), metadata.get("step")}
        if len(steps) != 1:
            return f"memory copy {path}: stale or mislabeled step (folder {copy.step}, marker {marker.get('step')}, metadata {metadata.get('step')})"
        if metadata.get("memory_rank") != copy.rank:
            return f"memory copy {path}: holds rank {metadata.get('memory_rank')}'s state, not rank {copy.rank}'s"
        for name, value in expected.items():
            if metadata.get(name) != value:
                return f"memory copy {path}: {name} {metadata.get(name)!r} differs from this run's {value!r}"
        if not read_shards:
            return None
        reader = ShardReader(path, document, MemoryFileStorage(), verify_checksums=True)
        for key, record in document["tensors"].items():
            for shard in record["shards"]:
                reader.read_shard(key, record, shard)
    except CheckpointError as e:
        return str(e)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"memory copy {path}: {type(e).__name__}: {e}"
    return None


def load_copy(path: Path, template: Any = None) -> LoadedCheckpoint:
    """Load the copy at ``path`` in this process alone (not collective), checksums checked.

    Raises:
        CheckpointError: as :func:`~lightning_ft.checkpoint.load_checkpoint`.
    """
    return load_checkpoint(path, template, storage=MemoryFileStorage(), collective=False)  # type: ignore[arg-type]


def remove_others(run_dir: Path, keep: list[Path], *, local_rank: int, local_world_size: int) -> None:
    """Delete the copies (and leftover temporary folders) of this rank's lane under ``run_dir`` except ``keep``.

    Only names the tier writes (``rank<r>``, ``peer-of-rank<r>``, ``step=<N>`` and their hidden temporaries) are
    touched; anything else in the folder is left alone. Not collective; never raises for a file already gone."""
    if not run_dir.is_dir():
        return
    kept = {Path(p) for p in keep}
    for lane in run_dir.iterdir():
        match = _LANE.fullmatch(lane.name)
        if match is None or not lane.is_dir() or int(match[2]) % local_world_size != local_rank:
            continue
        for child in lane.iterdir():
            ours = _STEP.fullmatch(child.name) or re.fullmatch(r"\.step=\d+\.(tmp|old)-\d+", child.name)
            if ours and child not in kept:
                _remove(child)
        try:
            lane.rmdir()  # only when empty
        except OSError:
            pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
