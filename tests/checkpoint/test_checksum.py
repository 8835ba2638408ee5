"""Shard checksums: the standard CRC32 (computed by zlib-ng where installed), and shards read straight into their
destination tensors, still checked."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from lightning_ft.checkpoint import CorruptCheckpointError, checksum, load_checkpoint
from lightning_ft.checkpoint.shard_reader import ShardReader
from tests.checkpoint.support import flip_a_byte_of, save


@pytest.mark.parametrize("size", [0, 1, 4095, 1 << 20])
def test_the_checksum_is_the_standard_crc32_of_any_buffer(size):
    data = np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8).copy()
    expected = zlib.crc32(data.tobytes())
    assert checksum.crc32(data) == expected
    assert checksum.crc32(memoryview(data)) == expected
    assert checksum.crc32(torch.from_numpy(data).numpy()) == expected


def test_zlib_ng_computes_it_where_it_is_installed():
    pytest.importorskip("zlib_ng")
    assert checksum.IMPLEMENTATION == "zlib-ng"


def test_a_checkpoint_checked_with_the_standard_library_alone_loads(tmp_path, monkeypatch):
    # Written with zlib-ng, read where it is absent: the same CRC32, so the format did not change.
    path = save(tmp_path / "step=1", 1, {"w": torch.randn(64, 64)})
    monkeypatch.setattr(checksum, "_crc32", zlib.crc32)
    assert load_checkpoint(path, collective=False).state["w"].shape == (64, 64)


def test_a_shard_that_is_exactly_the_destination_is_read_straight_into_it(tmp_path, monkeypatch):
    weight = torch.randn(32, 16)
    path = save(tmp_path / "step=1", 1, {"w": weight, "b": torch.arange(5)})
    monkeypatch.setattr(ShardReader, "assemble", lambda *a: pytest.fail("an intermediate copy was made"))
    target = {"w": torch.zeros(32, 16), "b": torch.zeros(5, dtype=torch.int64)}
    before = target["w"].data_ptr()
    loaded = load_checkpoint(path, target, collective=False)
    assert torch.equal(target["w"], weight) and torch.equal(target["b"], torch.arange(5))
    assert loaded.state["w"] is target["w"] and target["w"].data_ptr() == before


def test_a_destination_of_another_layout_is_filled_through_a_copy(tmp_path):
    weight = torch.randn(16, 32)
    path = save(tmp_path / "step=1", 1, {"w": weight})
    target = {"w": torch.zeros(32, 16).t()}  # not contiguous: read_into declines, assemble fills it
    load_checkpoint(path, target, collective=False)
    assert torch.equal(target["w"], weight)


def test_a_flipped_byte_read_straight_into_the_destination_fails_the_load(tmp_path):
    weight = torch.randn(64, 64)
    path = save(tmp_path / "step=1", 1, {"w": weight})
    flip_a_byte_of(path, weight)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(path, {"w": torch.zeros(64, 64)}, collective=False)


def test_crc32_combine_equals_crc_of_the_concatenation() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a = rng.randbytes(rng.choice([0, 1, 3, 64, 1000, 4097]))
        b = rng.randbytes(rng.choice([0, 1, 7, 64, 999, 70000]))
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    pieces = [b"", b"abc", b"", rng.randbytes(12345), b"", b"x"]
    crc = 0
    for piece in pieces:
        crc = checksum.crc32_combine(crc, zlib.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))
    with pytest.raises(ValueError, match="len2=-1"):
        checksum.crc32_combine(0, 0, -1)
