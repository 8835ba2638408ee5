"""Writing a ``torch.save`` file one tensor at a time, so that state larger than memory can be written.

``torch.save`` pickles an object and writes every tensor's bytes from memory. :func:`save_streaming` writes the same
file format from a structure whose tensors are :class:`TensorSlot` placeholders: first the structure itself, through
``torch.save`` under ``torch.serialization.skip_data()`` with uninitialised tensors (the file's records are laid out,
their bytes left as holes, and the tensors' memory is never touched), then each tensor's bytes, produced by the caller
one at a time, at its record's offset. Peak memory is the largest tensor plus what producing it needs. The result is an
ordinary ``torch.save`` file: ``torch.load(..., weights_only=True)`` (with ``mmap=True`` too) reads it.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["TensorSlot", "can_stream", "save_streaming"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


@dataclass(frozen=True)
class TensorSlot:
    """A tensor still to be produced: what the file records for it."""

    key: str
    """The caller's name for it (passed back to ``produce``)."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def can_stream() -> bool:
    """Whether this torch can write without holding the tensors (``torch.serialization.skip_data``: torch >= 2.5)."""
    return hasattr(torch.serialization, "skip_data")


def _skeleton(obj: Any, slots: list[TensorSlot]) -> Any:
    # Walks containers in the order pickle does (dict insertion order, depth first), which is the order torch.save
    # numbers the storages in: the n-th slot found here is record data/<n>.
    if isinstance(obj, TensorSlot):
        slots.append(obj)
        return torch.empty(obj.shape, dtype=obj.dtype)  # never written to: its pages are never allocated
    if isinstance(obj, dict):
        return {k: _skeleton(v, slots) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_skeleton(v, slots) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_skeleton(v, slots) for v in obj)
    return obj


def _data_offsets(path: Path) -> dict[str, int]:
    """Byte offset of each ``data/<key>`` record's bytes in the zip file at ``path``."""
    offsets = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
        for info in zf.infolist():
            head, _, key = info.filename.rpartition("/data/")
            if not head or "/" in head:
                continue
            raw.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
            name_len, extra_len = fields[9], fields[10]
            offsets[key] = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return offsets


def save_streaming(
    obj: Any,
    out: str | os.PathLike,
    produce: Callable[[TensorSlot], torch.Tensor],
    *,
    on_written: Callable[[TensorSlot], None] | None = None,
) -> Path:
    """Write ``obj`` (containers, plain values and :class:`TensorSlot` s) as a ``torch.save`` file at ``out``.

    ``produce(slot)`` returns the tensor for a slot (CPU, the slot's dtype and shape); it is called once per slot, in
    order, and its result is released before the next call. ``on_written(slot)`` follows each write (a progress bar).
    The file appears at ``out`` only when complete and fsync'd (a temporary name, then a rename).

    Raises:
        RuntimeError: this torch cannot stream (:func:`can_stream` is false).
        ValueError: ``produce`` returned a tensor of another shape or dtype.
    """
    if not can_stream():
        raise RuntimeError("streaming torch.save files needs torch >= 2.5 (torch.serialization.skip_data)")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    slots: list[TensorSlot] = []
    try:
        skeleton = _skeleton(obj, slots)
        with torch.serialization.skip_data():
            torch.save(skeleton, tmp)
        del skeleton
        offsets = _data_offsets(tmp)
        with open(tmp, "r+b") as f:
            for n, slot in enumerate(slots):
                if slot.nbytes:
                    tensor = produce(slot)
                    if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                        raise ValueError(
                            f"{slot.key}: produced {tensor.dtype} {list(tensor.shape)}, expected {slot.dtype}"
                            f" {list(slot.shape)}"
                        )
                    f.seek(offsets[str(n)])
                    f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
                    del tensor
                if on_written is not None:
                    on_written(slot)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
