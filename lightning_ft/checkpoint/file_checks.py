"""Whether a ``torch.save`` file is intact, and whether its content is what was saved, without trusting its pickle.

``torch.load`` checks no checksum (a memory-mapped load reads tensor bytes straight from the file), so two checks are
made here. :func:`damaged_records` reads every record of the zip against the CRC32 its directory keeps: a flipped byte
or a truncated copy fails it, a file rewritten by ``torch.save`` (an edit) passes. :func:`content_checksums` is the
CRC32 of every tensor of a checkpoint dict by its path, plus one over everything else: lightning-ft records it at a
save and compares it at a load, which tells an edit from the saved content
(:mod:`~lightning_ft.checkpoint.single_file`).
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint.checksum import crc32

__all__ = ["content_checksums", "damaged_records", "pickle_record", "stored_bytes"]


def pickle_record(archive: zipfile.ZipFile) -> zipfile.ZipInfo | None:
    for info in archive.infolist():
        parts = info.filename.split("/")
        if len(parts) == 2 and parts[1] == "data.pkl":
            return info
    return None


def stored_bytes(path: Path, info: zipfile.ZipInfo) -> bytes:
    """A stored (uncompressed) zip record's bytes as they are on disk, without zipfile's CRC check (done by callers
    that need it, so that a damaged file of ours is still recognized as ours)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"{info.filename} is compressed; torch.save stores records uncompressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"bad local header of {info.filename}")
        name_len = int.from_bytes(header[26:28], "little")
        extra_len = int.from_bytes(header[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        data = f.read(info.compress_size)
    if len(data) != info.compress_size:
        raise zipfile.BadZipFile(f"{info.filename} is truncated")
    return data


def damaged_records(path: str | os.PathLike) -> list[str]:
    """The records of the zip file ``path`` whose bytes fail the CRC32 the zip's directory records for them (``[]``:
    intact), or one phrase when its directory cannot be read. Reads the whole file; executes nothing."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad: list[str] = []
            for info in archive.infolist():
                try:
                    if zlib.crc32(stored_bytes(Path(path), info)) != info.CRC:
                        bad.append(info.filename)
                except (zipfile.BadZipFile, OSError):
                    bad.append(info.filename)
            return bad
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        return [f"its zip directory ({e})"]


def _tensor_crc(tensor: torch.Tensor) -> int:
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return crc32(data.contiguous().reshape(-1).view(torch.uint8).numpy())


class _TensorsByContent(pickle.Pickler):
    """Pickles an object with each tensor it holds replaced by its dtype, shape and CRC32: ``pickle`` writes a tensor
    as ``torch.save`` bytes that name its storage by identity, so the same object loaded back (an ``nn.Module`` in the
    hyperparameters, a metric with a buffer) would pickle differently. Without tensors, the bytes are
    ``pickle.dumps``'s."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            dense = obj.to_dense() if obj.layout != torch.strided else obj
            return ("tensor", str(dense.dtype), tuple(dense.shape), _tensor_crc(dense))
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", obj.nbytes(), crc32(bytes(obj.cpu())))
        return None


def _object_crc(value: Any) -> int:
    buffer = io.BytesIO()
    _TensorsByContent(buffer, protocol=4).dump(value)
    return zlib.crc32(buffer.getvalue())


def content_checksums(obj: Any, known: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The checksums of a checkpoint dict's content, as lightning-ft records them at a save and compares them at a
    load: ``{"tensors": {path: [dtype, shape, crc32]}, "objects": crc32}``, the CRC32 of each tensor's bytes by its
    slash-joined path, and one CRC32 over everything else (keys, values, types; sets in a fixed order). ``known``:
    CRC32s already computed, by ``id`` of the tensor (the staged copies' index). Objects of other classes count by
    their class and pickle (a class that cannot be pickled by its class alone)."""
    known = known or {}
    tensors: dict[str, Any] = {}
    parts: list[bytes] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                value = value.to_dense()
            crc = known.get(id(value))
            tensors[path] = [
                str(value.dtype).removeprefix("torch."),
                list(value.shape),
                crc if crc is not None else _tensor_crc(value),
            ]
            parts.append(b"T")
            return
        kind = type(value)
        parts.append(f"{kind.__module__}.{kind.__qualname__}:".encode())
        if isinstance(value, dict):
            for key, item in value.items():
                parts.append(repr(key).encode() + b"=")
                walk(item, f"{path}/{key}" if path else str(key))
            parts.append(b"}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}" if path else str(i))
            parts.append(b"]")
        elif isinstance(value, (set, frozenset)):
            parts.extend(sorted(repr(item).encode() for item in value))
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
            parts.append(repr(value).encode())
        elif isinstance(value, np.ndarray) and value.dtype != object:
            parts.append(value.dtype.str.encode() + repr(value.shape).encode() + np.ascontiguousarray(value).tobytes())
        elif isinstance(value, argparse.Namespace):
            walk(vars(value), path)
        else:
            try:
                parts.append(_object_crc(value).to_bytes(4, "little"))
            except Exception:  # noqa: BLE001 - an object that cannot be pickled by the standard pickler counts by type
                pass

    walk(obj, "")
    return {"tensors": tensors, "objects": zlib.crc32(b"\x00".join(parts))}
