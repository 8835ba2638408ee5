"""Writing one ``torch.save`` file from every rank at once: each rank writes about 1/N of the tensor bytes.

``torch.save`` (the default zip format) stores every record uncompressed, its bytes starting at a multiple of the
storage alignment (64), behind a local header whose CRC and sizes are zero: the CRC follows the bytes in a data
descriptor and is repeated in the central directory. So the whole layout follows from the record names and sizes
alone, before a byte is written. :func:`plan_file` computes it the way torch's writer (``PyTorchStreamWriter`` over
miniz, ZIP64 included) does; :func:`save` is the collective write: rank 0 sizes the file, every rank ``pwrite`` s its
share of the storages' bytes and their CRCs, rank 0 combines the CRCs of each record's pieces (:func:`crc32_combine`)
and writes the pickle, the small records, every header and descriptor and the central directory. The result is the
file ``torch.save(obj, path)`` writes, byte for byte (the ``.data/serialization_id`` record included), so
``torch.load(path, weights_only=True)`` (``mmap=True`` too) reads it in a process that never imported lightning-ft,
and ``zipfile`` checks every record's CRC.

Why one module: the offsets :func:`plan_file` computes are the ones every rank writes at and rank 0 describes in the
headers and the directory; torch's format (miniz's fields, torch's padding, the serialization id) is one concept, and
split between modules each half would restate the other's rules.

``ElasticFT3D(checkpoint_format="file")`` at two or more processes writes its checkpoints through it
(:class:`~lightning_ft.checkpoint.single_file.FileStorage`, from the background writer's process group, from the
staged CPU copies). It serves state every rank holds in full (data-parallel replicas); each rank reads its own copy of
the bytes it writes. Storages on an accelerator are copied to the CPU by torch's pickling on every rank (all of them,
not only the rank's share): the caller stages them first. Each rank's storages must hold the same bytes at the same
offsets as rank 0's: the check before any write compares the storages' sizes and every view into them (offset, shape,
stride, dtype, which storage) with rank 0's, and refuses a difference; the bytes themselves are the caller's to agree
on (:func:`~lightning_ft.checkpoint.file_commit.write_parallel_file` compares samples of them). With ``shares``, a rank
needs only the bytes it writes (:func:`staged_range`): the rest of its storages is never read.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import io
import mmap
import os
import pickle
import struct
import sys
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_ft._compat import torch_save_records
from lightning_ft.checkpoint.checksum import crc32, crc32_combine

__all__: list[str] = []  # internal: reached through lightning_ft.checkpoint.parallel_file only

_U32 = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")
_DESCRIPTOR_32 = struct.Struct("<4sIII")
_DESCRIPTOR_64 = struct.Struct("<4sIQQ")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_FLAG_UTF8 = 0x0800
_FLAG_DESCRIPTOR = 0x0008
CUT_ALIGNMENT_BYTES = 4096
"""Where a storage split between ranks may be cut: at a file offset that is a multiple of this (a page), so no page of
the file is written by two ranks except where a storage ends."""
_DIRECT_MIN_BYTES = 1 << 20
_BOUNCE_BYTES = 4 << 20
_MAX_WRITE = 1 << 30


# -- The layout --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordLayout:
    """Where one record of the zip lies."""

    name: str
    """The record's name in the archive, without the ``<archive>/`` prefix (``data.pkl``, ``data/0``, ...)."""
    size: int
    """Its bytes (stored uncompressed)."""
    header_offset: int
    """Where its local header starts."""
    data_offset: int
    """Where its bytes start: a multiple of the storage alignment."""
    local_header: bytes
    """The local header, name and extra field (CRC and sizes are zero there: torch's writer uses a data descriptor)."""

    @property
    def zip64(self) -> bool:
        return self.size >= _U32 or self.header_offset >= _U32

    @property
    def descriptor_size(self) -> int:
        if self.size == 0:
            return 0  # torch's writer adds no data descriptor to an empty record
        return _DESCRIPTOR_64.size if self.zip64 else _DESCRIPTOR_32.size


@dataclass(frozen=True)
class Piece:
    """A byte range of one storage record that one rank writes."""

    record: int
    """Index into :attr:`FileLayout.records`."""
    start: int
    """First byte, counted from the record's first byte."""
    length: int
    rank: int


@dataclass(frozen=True)
class FileLayout:
    """Every byte offset of the file, and which rank writes which storage bytes. The same on every rank."""

    archive_name: str
    records: tuple[RecordLayout, ...]
    """In file order: ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0`` ...,
    ``version``, ``.data/serialization_id``."""
    central_directory_offset: int
    size: int
    """The file's size in bytes."""
    pieces: tuple[Piece, ...]
    """The storages' bytes split between the ranks, in file order."""

    def pieces_of(self, rank: int) -> list[Piece]:
        return [piece for piece in self.pieces if piece.rank == rank]


def archive_name_for(path: str | os.PathLike[str]) -> str:
    """The folder name torch's writer puts every record under for a file at ``path``: its name up to the last dot
    (``PyTorchStreamWriter``'s ``basename``), or ``archive`` where the path is not ASCII (torch then writes through a
    Python file object)."""
    text = os.fspath(path)
    try:
        text.encode("ascii")
    except UnicodeEncodeError:
        return "archive"
    base = text.replace("\\", "/").rsplit("/", 1)[-1]
    stem = base[: base.rfind(".")] if "." in base else base
    if not stem:
        raise ValueError(f"path={text!r}: torch.save cannot write a file whose name is empty before its last dot")
    return stem


def _padding_extra(cursor: int, name_size: int, size: int, alignment: int) -> bytes:
    # torch's detail::getPadding: an "FB" extra field of 'Z's that puts the data at a multiple of the alignment,
    # counted after the ZIP64 extra field miniz adds to the local header of a large record or at a large offset.
    start = cursor + _LOCAL_HEADER.size + name_size + 4
    if size >= _U32 or cursor >= _U32:
        start += 4 + (16 if size >= _U32 else 0) + (8 if cursor >= _U32 else 0)
    padding = -start % alignment
    return b"FB" + struct.pack("<H", padding) + b"Z" * padding


def _zip64_extra(size: int, offset: int, compressed: int) -> bytes:
    fields = []
    if size >= _U32:
        fields += [size, compressed]
    if offset >= _U32:
        fields.append(offset)
    if not fields:
        return b""
    return struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)


def _local_header(full_name: bytes, size: int, offset: int, alignment: int) -> bytes:
    # miniz writes the ZIP64 field of the local header with the compressed size still 0 (it is not known yet).
    extra = _zip64_extra(size, offset, 0) + _padding_extra(offset, len(full_name), size, alignment)
    flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if size else 0)
    return _LOCAL_HEADER.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full_name), len(extra)) + full_name + extra


def plan_layout(
    archive_name: str,
    record_sizes: list[tuple[str, int]],
    *,
    storage_count: int,
    world_size: int,
    alignment: int = 64,
    shares: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
) -> FileLayout:
    """The layout of a file holding ``record_sizes`` (``(name, size)`` in torch's order, ``version`` and
    ``.data/serialization_id`` included), with the ``storage_count`` ``data/<k>`` records split between ``world_size``
    ranks. Pure: every rank computes the same layout from the same arguments.

    ``shares`` (``{record name: [(rank, start, end), ...]}``, each record's ranges contiguous from 0 to its size, see
    :func:`nominal_shares`) fixes who writes which bytes of those records instead of an even split of all storages in
    file order: each cut between two ranks moves down to a page of the file, so a rank writes at most
    :data:`CUT_ALIGNMENT_BYTES` below its range and never above it (:func:`staged_range`); a record not in ``shares``
    is written whole by rank 0."""
    prefix = archive_name.encode("ascii") + b"/"
    records = []
    cursor = 0
    for name, size in record_sizes:
        header = _local_header(prefix + name.encode("ascii"), size, cursor, alignment)
        data_offset = cursor + len(header)
        if data_offset % alignment:  # pragma: no cover - internal invariant
            raise AssertionError(f"record {name} would start at {data_offset}, not a multiple of {alignment}")
        record = RecordLayout(name, size, cursor, data_offset, header)
        records.append(record)
        cursor = data_offset + size + record.descriptor_size
    central = cursor
    central_size = sum(
        _CENTRAL_HEADER.size + len(prefix) + len(r.name) + len(_zip64_extra(r.size, r.header_offset, r.size))
        for r in records
    )
    size = central + central_size + _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size
    storage_records = [i for i, r in enumerate(records) if r.name.startswith("data/")]
    if len(storage_records) != storage_count:  # pragma: no cover - internal invariant
        raise AssertionError(f"{len(storage_records)} data/ records for {storage_count} storages")
    if shares is None:
        pieces = _split(records, storage_records, world_size)
    else:
        pieces = _split_by_shares(records, storage_records, shares)
    return FileLayout(archive_name, tuple(records), central, size, pieces)


def _split(records: list[RecordLayout], storage_records: list[int], world_size: int) -> tuple[Piece, ...]:
    # The storages' bytes, one after the other, cut into world_size ranges of about equal size; a cut inside a storage
    # is moved down to a page boundary of the file (CUT_ALIGNMENT_BYTES), where the next rank's writes start.
    total = sum(records[i].size for i in storage_records)
    cuts = []
    for rank in range(1, world_size):
        target = total * rank // world_size
        seen = 0
        for i in storage_records:
            size = records[i].size
            if seen + size > target:
                start = records[i].data_offset
                into = (start + target - seen) // CUT_ALIGNMENT_BYTES * CUT_ALIGNMENT_BYTES - start
                cuts.append(seen + max(into, 0))
                break
            seen += size
        else:
            cuts.append(total)
    bounds = [0, *(max(cut, 0) for cut in cuts), total]
    for k in range(1, len(bounds)):
        bounds[k] = max(bounds[k], bounds[k - 1])
    pieces = []
    seen = 0
    for i in storage_records:
        size = records[i].size
        for rank in range(world_size):
            lo = max(bounds[rank], seen)
            hi = min(bounds[rank + 1], seen + size)
            if hi > lo:
                pieces.append(Piece(i, lo - seen, hi - lo, rank))
        seen += size
    return tuple(pieces)


def _split_by_shares(
    records: list[RecordLayout], storage_records: list[int], shares: Mapping[str, Sequence[tuple[int, int, int]]]
) -> tuple[Piece, ...]:
    pieces = []
    for i in storage_records:
        record = records[i]
        if not record.size:
            continue
        ranges = shares.get(record.name)
        if not ranges:
            pieces.append(Piece(i, 0, record.size, 0))
            continue
        if (
            ranges[0][1] != 0
            or ranges[-1][2] != record.size
            or any(a[2] != b[1] for a, b in zip(ranges, ranges[1:], strict=False))
        ):
            raise ValueError(f"shares of {record.name} do not cover its {record.size} bytes in order: {list(ranges)}")
        start = 0
        for k, (rank, _, end) in enumerate(ranges):
            if k + 1 < len(ranges):  # a cut inside the record: down to a page of the file, never below the last one
                page = (record.data_offset + end) // CUT_ALIGNMENT_BYTES * CUT_ALIGNMENT_BYTES
                end = max(start, page - record.data_offset)
            if end > start:
                pieces.append(Piece(i, start, end - start, rank))
            start = end
    return tuple(pieces)


def nominal_shares(sizes: Sequence[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    """Who writes which bytes of tensors of ``sizes`` bytes (the replicated state, in a fixed order every rank knows):
    their bytes, one tensor after the other, cut into ``world_size`` ranges of about equal size; for each tensor its
    ``(rank, start, end)`` byte ranges, contiguous, covering it (none for an empty one). Known before the file's
    layout (which depends on the pickle): :func:`plan_layout` moves each cut down to a page of the file."""
    total = sum(sizes)
    bounds = [total * rank // world_size for rank in range(world_size + 1)]
    out: list[list[tuple[int, int, int]]] = []
    seen = 0
    for size in sizes:
        ranges = []
        for rank in range(world_size):
            lo, hi = max(bounds[rank], seen), min(bounds[rank + 1], seen + size)
            if hi > lo:
                ranges.append((rank, lo - seen, hi - seen))
        out.append(ranges)
        seen += size
    return out


def staged_range(ranges: Sequence[tuple[int, int, int]], rank: int) -> tuple[int, int]:
    """The bytes ``[start, end)`` of a tensor that ``rank`` must hold to write its piece of it whatever the file's
    layout: its range of :func:`nominal_shares`, from :data:`CUT_ALIGNMENT_BYTES` lower (where :func:`plan_layout`
    may move its first cut); ``(0, 0)``: none."""
    mine = [(lo, hi) for r, lo, hi in ranges if r == rank]
    if not mine:
        return 0, 0
    return max(0, mine[0][0] - CUT_ALIGNMENT_BYTES), mine[-1][1]


# -- What torch.save would write -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilePlan:
    """What this rank needs to write its part: the layout, the small records' bytes and its own storages."""

    layout: FileLayout
    payloads: dict[str, bytes]
    """The small records (``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``version``)."""
    storages: dict[str, torch.UntypedStorage]
    """Each ``data/<k>`` record's CPU storage, as torch.save found it in the object."""


def plan_file(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    world_size: int = 1,
    data_pkl_size: int | None = None,
    shares: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
) -> FilePlan:
    """Pickle ``obj`` as ``torch.save(obj, path)`` does and lay out the file it would write, its storages split between
    ``world_size`` ranks. ``data_pkl_size`` overrides the pickle's size in the layout (rank 0's, where this rank's
    pickle differs from it only in device names). ``shares``: who writes which bytes of the storages it names by their
    ``data_ptr()`` (see :func:`plan_layout`). Runs on one rank; no collective."""
    records = torch_save_records(obj)
    payloads: dict[str, bytes] = {}
    storages: dict[str, torch.UntypedStorage] = {}
    names: list[tuple[str, int]] = []
    for name, data in records:
        if name.startswith("data/"):
            storages[name] = data
            names.append((name, data.nbytes()))
        else:
            payloads[name] = data.encode("ascii") if isinstance(data, str) else bytes(data)
            names.append((name, len(payloads[name])))
    if "byteorder" not in payloads:  # pragma: no cover - torch always writes it from Python
        payloads["byteorder"] = sys.byteorder.encode("ascii")
        names.append(("byteorder", len(payloads["byteorder"])))
    payloads["version"] = _torch_writer_reference(0)[0]
    names.append(("version", len(payloads["version"])))
    names.append((".data/serialization_id", 40))
    if data_pkl_size is not None:
        names[0] = ("data.pkl", data_pkl_size)
    alignment = int(payloads[".storage_alignment"])
    by_name = None
    if shares is not None:
        by_name = {
            name: shares[storage.data_ptr()]
            for name, storage in storages.items()
            if storage.nbytes() and storage.data_ptr() in shares
        }
    layout = plan_layout(
        archive_name_for(path),
        names,
        storage_count=len(storages),
        world_size=world_size,
        alignment=alignment,
        shares=by_name,
    )
    return FilePlan(layout, payloads, storages)


@functools.cache
def _torch_writer_reference(storage_count: int) -> tuple[bytes, str]:
    # What torch's C++ writer adds on its own, asked of it for a file with the same record names and empty storages:
    # the ``version`` record (its format version, "3\n" in torch 2.13) and the first half of ``serialization_id``, a
    # hash of the record names taken in the order of a C++ unordered_set (libstdc++'s std::hash and bucket order).
    buffer = io.BytesIO()
    torch.save([torch.empty(0) for _ in range(storage_count)], buffer)
    buffer.seek(0)
    with zipfile.ZipFile(buffer) as archive:
        version = archive.read("archive/version")
        return version, archive.read("archive/.data/serialization_id").decode("ascii")[:20]


def _hash_combine(seed: int, value: int) -> int:
    # c10::hash_combine on 64-bit size_t.
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & 0xFFFFFFFFFFFFFFFF


def _serialization_id(layout: FileLayout, crcs: list[int]) -> bytes:
    # torch's writer: 20 digits of the record names' hash, then 20 digits of the hash_combine of the CRC of every
    # record written before it with a data descriptor (every non-empty one), in file order.
    combined = 0
    for record, crc in zip(layout.records[:-1], crcs, strict=False):
        if record.size:
            combined = _hash_combine(combined, crc)
    storage_count = sum(1 for r in layout.records if r.name.startswith("data/"))
    return f"{_torch_writer_reference(storage_count)[1]}{combined:020d}".encode("ascii")


def finish_file(fd: int, plan: FilePlan, storage_crcs: dict[int, int], *, data_pkl: bytes | None = None) -> int:
    """Write every byte of the file that is not a storage's (rank 0's part): the small records, every local header,
    data descriptor and the central directory, given each storage record's CRC (``{record index: crc}``). Returns the
    number of bytes written."""
    layout = plan.layout
    payloads = dict(plan.payloads)
    if data_pkl is not None:
        payloads["data.pkl"] = data_pkl
    crcs: list[int] = []
    writes: list[tuple[int, bytes]] = []
    for index, record in enumerate(layout.records):
        if record.name == ".data/serialization_id":
            payloads[record.name] = _serialization_id(layout, crcs)
        if record.name in payloads:
            data = payloads[record.name]
            if len(data) != record.size:
                raise AssertionError(f"record {record.name}: {len(data)} bytes planned as {record.size}")
            crc = crc32(data) if data else 0
            body = data
        else:
            crc = storage_crcs[index] if record.size else 0
            body = b""
        crcs.append(crc)
        writes.append((record.header_offset, record.local_header + body))
        if record.descriptor_size == _DESCRIPTOR_64.size:
            writes.append(
                (record.data_offset + record.size, _DESCRIPTOR_64.pack(b"PK\x07\x08", crc, record.size, record.size))
            )
        elif record.descriptor_size:
            writes.append(
                (record.data_offset + record.size, _DESCRIPTOR_32.pack(b"PK\x07\x08", crc, record.size, record.size))
            )
    writes.append((layout.central_directory_offset, _central_directory(layout, crcs)))
    written = 0
    for offset, data in writes:
        written += _pwrite_all(fd, memoryview(data), offset)
    return written


def _central_directory(layout: FileLayout, crcs: list[int]) -> bytes:
    prefix = layout.archive_name.encode("ascii") + b"/"
    out = bytearray()
    for record, crc in zip(layout.records, crcs, strict=True):
        name = prefix + record.name.encode("ascii")
        extra = _zip64_extra(record.size, record.header_offset, record.size)
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if record.size else 0)
        small = min(record.size, _U32)
        out += _CENTRAL_HEADER.pack(
            b"PK\x01\x02",
            0,
            0,
            flags,
            0,
            0,
            0,
            crc,
            small,
            small,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(record.header_offset, _U32),
        )
        out += name + extra
    count = len(layout.records)
    central = layout.central_directory_offset
    end64 = central + len(out)
    out += _ZIP64_END.pack(b"PK\x06\x06", _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, count, count, len(out), central)
    out += _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, end64, 1)
    out += _END.pack(
        b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(end64 - central, _U32), min(central, _U32), 0
    )
    if central + len(out) != layout.size:  # pragma: no cover - internal invariant
        raise AssertionError(f"central directory ends at {central + len(out)}, planned {layout.size}")
    return bytes(out)


def _open_direct(path: str | os.PathLike[str]) -> int | None:
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(os.fspath(path), os.O_WRONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None  # the file system has no O_DIRECT (tmpfs on older kernels, some network file systems)
        raise


def _allocate(fd: int, size: int) -> None:
    # Reserve the file's blocks before the ranks write (measured: writes into a fresh file then take about half the
    # time). Linux's fallocate(2) itself: glibc's posix_fallocate writes a byte per block where the file system cannot
    # allocate (NFS), which would make rank 0 write the whole file. Where it fails, the file stays sparse: no harm.
    libc = _libc()
    if libc is not None and size:
        libc.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        return libc
    except (OSError, AttributeError):  # pragma: no cover - a libc without fallocate
        return None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return memoryview(flat.numpy()).cast("B")


def write_pieces(
    fd: int, plan: FilePlan, rank: int, *, direct_fd: int | None = None
) -> tuple[dict[int, list[tuple[int, int, int]]], int]:
    """``pwrite`` this rank's pieces of the storages at their planned offsets; the whole pages inside a piece of at
    least 1 MiB through ``direct_fd`` (the file opened with ``O_DIRECT``) where given, the rest through ``fd``. Returns
    ``{record index: [(start, length, crc), ...]}`` and the number of bytes written."""
    layout = plan.layout
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    written = 0
    direct = _Direct(direct_fd) if direct_fd is not None else None
    try:
        for piece in layout.pieces_of(rank):
            record = layout.records[piece.record]
            view = _storage_bytes(plan.storages[record.name])[piece.start : piece.start + piece.length]
            crc = _write_piece(fd, direct, view, record.data_offset + piece.start)
            written += view.nbytes
            crcs.setdefault(piece.record, []).append((piece.start, piece.length, crc))
    finally:
        if direct is not None:
            direct.close()
    return crcs, written


_bounce_buffers: SimpleQueue[mmap.mmap] = SimpleQueue()  # reused: a fresh mapping costs its first touch again


class _Direct:
    """Writes whole pages without the page cache: a new file's pages cost more to allocate in the cache than to copy
    (see :mod:`~lightning_ft.checkpoint.direct_write`). A storage's bytes are rarely page-aligned in memory at the
    file's page boundaries, so they go through two page-aligned bounce buffers: while one is written (a thread: the
    write releases the GIL) the next chunk is copied into the other and its CRC taken there, in cache."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.failed = False
        self._buffers: list[mmap.mmap] = []
        self._pool: ThreadPoolExecutor | None = None

    def write(self, view: memoryview, offset: int, crc: int) -> int | None:
        """Write ``view`` (whole pages) at ``offset`` (a page boundary); the CRC ``crc`` continued over ``view``, or
        ``None`` where the file system refuses ``O_DIRECT`` (the caller then writes the same bytes buffered)."""
        if self.failed:
            return None
        try:
            if _address(view) % CUT_ALIGNMENT_BYTES == 0:
                for lo in range(0, view.nbytes, _MAX_WRITE):
                    _pwrite_all(self.fd, view[lo : lo + _MAX_WRITE], offset + lo)
                return crc32(view, crc)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lightning-ft-pwrite")
                while len(self._buffers) < 2:
                    try:
                        self._buffers.append(_bounce_buffers.get_nowait())
                    except Empty:
                        self._buffers.append(mmap.mmap(-1, _BOUNCE_BYTES))  # anonymous mappings are page-aligned
            pending: Future[int] | None = None
            try:
                for k, lo in enumerate(range(0, view.nbytes, _BOUNCE_BYTES)):
                    chunk = view[lo : lo + _BOUNCE_BYTES]
                    staged = memoryview(self._buffers[k % 2])[: chunk.nbytes]
                    staged[:] = chunk  # the write two chunks back, from this buffer, has returned
                    crc = crc32(staged, crc)
                    if pending is not None:
                        pending.result()
                    pending = self._pool.submit(_pwrite_all, self.fd, staged, offset + lo)
                    del staged
            finally:
                if pending is not None:
                    pending.result()
            return crc
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.failed = True
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for buffer in self._buffers:
            _bounce_buffers.put(buffer)
        self._buffers = []


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def _write_piece(fd: int, direct: _Direct | None, view: memoryview, offset: int) -> int:
    """Write ``view`` at ``offset``; its CRC32."""
    end = offset + view.nbytes
    lo = -(-offset // CUT_ALIGNMENT_BYTES) * CUT_ALIGNMENT_BYTES
    hi = end // CUT_ALIGNMENT_BYTES * CUT_ALIGNMENT_BYTES
    if direct is None or hi - lo < _DIRECT_MIN_BYTES:
        _pwrite_all(fd, view, offset)
        return crc32(view)
    head, inner, tail = view[: lo - offset], view[lo - offset : hi - offset], view[hi - offset :]
    _pwrite_all(fd, head, offset)
    crc = crc32(head)
    inner_crc = direct.write(inner, lo, crc)
    if inner_crc is None:
        _pwrite_all(fd, inner, lo)
        inner_crc = crc32(inner, crc)
    _pwrite_all(fd, tail, hi)
    return crc32(tail, inner_crc)


def write_ranges(
    fd: int, path: str | os.PathLike[str], ranges: list[tuple[memoryview, int]], *, direct_io: bool = True
) -> list[int]:
    """``pwrite`` each ``(bytes, file offset)`` of ``ranges`` into the open file ``fd`` (``path``), the whole pages of
    a range of at least 1 MiB through ``O_DIRECT`` where ``direct_io`` and the file system allow it (as
    :func:`write_pieces`); returns each range's CRC32. For writers whose bytes are not one storage of a planned object
    (:mod:`~lightning_ft.checkpoint.sharded_file`: a rank's shards of full tensors)."""
    direct_fd = _open_direct(path) if direct_io else None
    direct = _Direct(direct_fd) if direct_fd is not None else None
    try:
        return [_write_piece(fd, direct, view, offset) for view, offset in ranges]
    finally:
        if direct is not None:
            direct.close()
        if direct_fd is not None:
            os.close(direct_fd)


def combine_pieces(layout: FileLayout, pieces: list[tuple[int, int, int]], record: int) -> int:
    """The CRC of a storage record from its pieces' ``(start, length, crc)``, which must cover it exactly."""
    crc = 0
    end = 0
    for start, length, piece_crc in sorted(pieces):
        if start != end:
            raise AssertionError(f"record {layout.records[record].name}: piece at {start}, expected {end}")
        crc = crc32_combine(crc, piece_crc, length)
        end = start + length
    if end != layout.records[record].size:
        raise AssertionError(
            f"record {layout.records[record].name}: pieces cover {end} of {layout.records[record].size}"
        )
    return crc


# -- The collective ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    """What one rank did in :func:`save`."""

    file_bytes: int
    """The file's size."""
    bytes_written: int
    """Bytes this rank passed to ``pwrite`` (its pieces; rank 0 adds the pickle, headers and directory)."""
    storage_bytes: int
    """Of ``bytes_written``, the storages' bytes."""
    phases_s: dict[str, float]
    """Seconds this rank spent in each phase: ``plan`` (pickle, layout, the structure check), ``write`` (``pwrite`` and
    CRC of its pieces), ``fsync``, ``gather`` (the CRCs to rank 0), ``finish`` (rank 0: headers and directory, their
    fsync; other ranks: waiting for it)."""


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    direct_io: bool = True,
    shares: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
    finalize: Callable[[dict[int, int]], Any] | None = None,
) -> SaveResult:
    """Write ``obj`` to ``path`` as ``torch.save(obj, path)`` would, each rank of ``group`` writing about 1/N of the
    storages' bytes.

    Collective: every rank of ``group`` (``None``: the default group; no process group initialised: this process
    alone) calls it with the same ``path`` and an object of the same structure and storage sizes whose tensor bytes are
    equal on every rank (data-parallel replicas: each rank writes its share from its own copy). It blocks until the
    file is complete on every rank: its pieces written and fsync'ed, rank 0's pickle, headers and central directory
    written and fsync'ed. The caller may mutate the tensors once it returns. ``path``'s folder must be visible to every
    rank (a shared file system). ``direct_io``: the whole pages of large pieces bypass the page cache (``O_DIRECT``)
    where the file system allows it; the file is the same either way. The file's directory entry is not fsync'ed: the
    caller publishes it (rename, then fsync the folder). On a failure on any rank every rank raises, and the file is
    incomplete.

    ``shares`` (the same on every rank; ``{storage data_ptr(): [(rank, start, end), ...]}``, see
    :func:`nominal_shares`) fixes which rank writes which bytes of the storages it names, so a rank may hold only the
    bytes it writes (:func:`staged_range`; the rest of such a storage is never read). ``finalize`` (rank 0, with
    ``shares``): given each storage's CRC32 by its ``data_ptr()``, once every rank has written its pieces, returns the
    object whose pickle rank 0 writes as ``data.pkl`` in place of ``obj``'s: the same structure and storages, and a
    pickle of exactly the same size (``obj`` holding placeholders of the same width: a checksum of the whole state no
    rank has read).

    Raises:
        ValueError: the ranks' objects differ in structure, storage sizes or the views into their storages (storage
            offsets, shapes, strides, dtypes, tensors sharing a storage), or in ``shares`` (nothing written).
        RuntimeError: a rank failed to write; the message names it.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world_size = dist.get_world_size(group) if distributed else 1
    clock = _Phases()
    cause: BaseException | None = None
    if not distributed:
        local = plan_file(obj, path, world_size=world_size, shares=shares)
        data_pkl = local.payloads["data.pkl"]
        plan = local
    else:
        # Every rank's storages and the views into them against rank 0's, before a byte is written: a rank writes its
        # pieces from its own storages at rank 0's offsets. Rank 0's pickle sets the offsets (a rank's own may differ
        # in device names only).
        mine: tuple[Any, ...]
        try:
            local = plan_file(obj, path, world_size=world_size, shares=shares)
            data_pkl = local.payloads["data.pkl"]
            plan = local
            mine = (_structure_digest(obj, local, shares), len(data_pkl), None)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below, or the others hang in it
            mine, cause = (None, 0, f"rank {rank}: {exc!r}"), exc
        digests: list[Any] = [None] * world_size
        dist.all_gather_object(digests, mine, group=group)
        failed = [d[2] for d in digests if d[2]]
        if failed:
            raise ValueError(f"save(path={os.fspath(path)!r}) could not be planned: {'; '.join(failed)}") from cause
        reference = digests[0]
        differing = [r for r, d in enumerate(digests) if d[0] != reference[0]]
        if differing:
            raise ValueError(
                f"save(path={os.fspath(path)!r}): ranks {differing} hold objects whose structure, storage sizes or "
                "views into their storages (offsets, shapes, strides, dtypes, shared storages) differ from rank 0's;"
                " every rank must pass the same (replicated) state"
            )
        if reference[1] != len(data_pkl):
            plan = plan_file(obj, path, world_size=world_size, data_pkl_size=reference[1], shares=shares)
    clock.mark("plan")
    error = None
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    written = 0
    try:
        # Nobody empties the file first: every byte below the planned size is written by some rank (headers, padding
        # and the directory by rank 0), so a stale file at the path is overwritten whole once rank 0 has cut it to
        # size, and no rank waits for another before writing.
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT, 0o644)
        direct_fd = _open_direct(path) if direct_io else None
        try:
            if rank == 0:
                os.ftruncate(fd, plan.layout.size)
                _allocate(fd, plan.layout.size)
            pieces, written = write_pieces(fd, plan, rank, direct_fd=direct_fd)
            clock.mark("write")
            os.fsync(fd)
            clock.mark("fsync")
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below, or the others hang in it
        error = f"rank {rank}: {exc!r}"
        cause = exc
    gathered: list[Any] = [(pieces, error)]
    if distributed:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (pieces, error), group=group)
    clock.mark("gather")
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError(f"save(path={os.fspath(path)!r}) failed: {'; '.join(errors)}") from cause
    storage_bytes = written
    final_error = None
    if rank == 0:
        try:
            by_record: dict[int, list[tuple[int, int, int]]] = {}
            for rank_pieces, _ in gathered:
                for record, items in rank_pieces.items():
                    by_record.setdefault(record, []).extend(items)
            crcs = {record: combine_pieces(plan.layout, items, record) for record, items in by_record.items()}
            if finalize is not None:
                data_pkl = _final_pickle(finalize, plan, crcs)
            fd = os.open(os.fspath(path), os.O_WRONLY)
            try:
                written += finish_file(fd, plan, crcs, data_pkl=data_pkl)
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for this outcome
            final_error = f"rank 0 writing the headers and directory: {exc!r}"
            cause = exc
    if distributed:
        status = [final_error]
        dist.broadcast_object_list(status, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        final_error = status[0]
    if final_error:
        raise RuntimeError(f"save(path={os.fspath(path)!r}) failed: {final_error}") from cause
    clock.mark("finish")
    return SaveResult(plan.layout.size, written, storage_bytes, clock.phases)


class _Phases:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def _final_pickle(finalize: Callable[[dict[int, int]], Any], plan: FilePlan, crcs: dict[int, int]) -> bytes:
    """Rank 0: the pickle of ``finalize``'s object, given every storage's CRC32 by its ``data_ptr()``."""
    by_pointer = {}
    for index, record in enumerate(plan.layout.records):
        if record.name.startswith("data/") and record.size:
            by_pointer[plan.storages[record.name].data_ptr()] = crcs[index]
    final = dict(torch_save_records(finalize(by_pointer)))["data.pkl"]
    data_pkl = final.encode("ascii") if isinstance(final, str) else bytes(final)
    planned = plan.layout.records[0].size
    if len(data_pkl) != planned:  # pragma: no cover - internal invariant of the caller's placeholders
        raise AssertionError(f"the final pickle holds {len(data_pkl)} bytes, the layout {planned}")
    return data_pkl


def _structure_digest(obj: Any, plan: FilePlan, shares: Mapping[int, Sequence[tuple[int, int, int]]] | None) -> str:
    # What a rank's pieces depend on besides rank 0's pickle: the storage records' names and sizes, who writes which
    # bytes of each, and every view into them (storage, offset, shape, stride, dtype) in pickling order: two ranks
    # whose storages have the same sizes but hold their tensors at other offsets would mix their bytes in one file.
    sizes = [(r.name, r.size) for r in plan.layout.records if r.name.startswith("data/")]
    ranges = None
    if shares is not None:
        ranges = [(name, list(shares.get(s.data_ptr(), ()))) for name, s in plan.storages.items() if s.nbytes()]
    return hashlib.sha256(repr((sizes, ranges, _views(obj))).encode()).hexdigest()


def _views(obj: Any) -> list[tuple[Any, ...]]:
    """Every tensor of ``obj`` as torch.save meets it (a pickling pass that stops at tensors): which storage (by order
    of first appearance), its byte size and dtype, the storage offset, shape and stride."""
    storages: dict[tuple[int, int], int] = {}
    views: list[tuple[Any, ...]] = []

    class _Walker(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta:
                try:
                    storage = value.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a subclass without one: its parts are walked instead
                    return None
                index = storages.setdefault((storage.data_ptr(), storage.nbytes()), len(storages))
                views.append(
                    (
                        index,
                        storage.nbytes(),
                        str(value.dtype),
                        value.storage_offset(),
                        tuple(value.shape),
                        value.stride(),
                    )
                )
                return ("tensor", len(views))
            if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)):
                views.append(("storage", value.nbytes()))
                return ("storage", len(views))
            return None

    _Walker(_Discard(), protocol=2).dump(obj)
    return views


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)
