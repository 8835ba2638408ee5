"""The checksum of checkpoint bytes: CRC32, computed by zlib-ng where it is installed.

Every shard's bytes get a CRC32 at save (in the background writer) and are checked against it at load. zlib-ng's
``crc32`` (the ``zlib-ng`` package, a dependency on the platforms it ships wheels for) computes the same CRC32 as the
standard library's ``zlib.crc32`` with carry-less multiplication instructions, about 4x faster here (3.9 against 17.7 ms
of CPU per 100 MiB); both accept any buffer, such as a NumPy view of a tensor, without a copy. Where zlib-ng is absent
the standard library computes the same value, so a checkpoint is checked the same way whichever wrote or reads it: the
format is unchanged. :func:`crc32_combine` gives the CRC32 of a concatenation from its parts' CRCs (a file written in
pieces by several ranks: lightning_ft/checkpoint/parallel_file.py).
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - platforms without zlib-ng wheels
    _crc32 = zlib.crc32

__all__ = ["IMPLEMENTATION", "crc32", "crc32_combine"]

IMPLEMENTATION = "zlib-ng" if _crc32 is not zlib.crc32 else "zlib"
"""Which library computes :func:`crc32` in this process."""


def crc32(data: Any, value: int = 0) -> int:
    """The CRC32 of ``data`` (bytes or any contiguous buffer: a NumPy array, a ``memoryview``), as ``zlib.crc32``;
    ``value``: the CRC32 of the bytes before ``data``, to continue it (a running CRC)."""
    return _crc32(data, value)


_CRC_POLY = 0xEDB88320


def _gf2_times(matrix: list[int], vector: int) -> int:
    total = 0
    row = 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


@functools.cache
def _zeros_operator(power: int) -> list[int]:
    """The GF(2) matrix that advances a CRC32 register over ``2**power`` zero bytes."""
    if power == 0:
        one_bit = [_CRC_POLY] + [1 << n for n in range(31)]
        two_bits = _gf2_square(one_bit)
        four_bits = _gf2_square(two_bits)
        return _gf2_square(four_bits)
    return _gf2_square(_zeros_operator(power - 1))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)`` (zlib's
    ``crc32_combine``, which Python's ``zlib`` does not expose), by the GF(2) matrix method: ``crc1`` advanced over
    ``len2`` zero bytes, xor ``crc2``. The operators for each power of two are computed once per process."""
    if len2 < 0:
        raise ValueError(f"crc32_combine(len2={len2}): a length is >= 0")
    power = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_operator(power), crc1)
        len2 >>= 1
        power += 1
    return crc1 ^ crc2
