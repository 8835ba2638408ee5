"""Checkpoint data files are written without the page cache (O_DIRECT) where the filesystem allows it, byte-exact."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from lightning_ft.checkpoint.direct_write import ALIGNMENT, aligned_empty, supports_direct_io, write_file
from lightning_ft.checkpoint.internal import SnapshotStorage
from lightning_ft.checkpoint.ownership import regions_to_write
from lightning_ft.checkpoint.staging import Stager, encode_state

O_DIRECT = getattr(os, "O_DIRECT", 0)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _aligned_bytes(n: int, seed: int) -> torch.Tensor:
    out = aligned_empty((n,), torch.uint8)
    out.copy_(_bytes(n, seed))
    return out


def _record_opens(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        opened.append((str(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return opened


PART_SETS = {
    "one aligned shard": lambda: [_aligned_bytes(3 * ALIGNMENT, 0)],
    "aligned shard with a tail": lambda: [_aligned_bytes(5 * ALIGNMENT + 123, 1)],
    "unaligned memory": lambda: [_bytes(3 * ALIGNMENT + 1, 2)[1:]],
    "a batch of small entries": lambda: [_bytes(1000 + 37 * i, i) for i in range(20)],
    "tail then aligned shards": lambda: [_aligned_bytes(777, 3), _aligned_bytes(2 * ALIGNMENT, 4), _bytes(10, 5)],
    "larger than the bounce buffer": lambda: [_bytes(9 << 20, 6)[3:], _aligned_bytes(ALIGNMENT, 7)],
    "empty parts": lambda: [_bytes(0, 8), _aligned_bytes(ALIGNMENT, 9), _bytes(0, 10)],
    "nothing": lambda: [],
}


@pytest.mark.parametrize("parts", list(PART_SETS), ids=list(PART_SETS))
def test_a_file_written_without_the_page_cache_holds_exactly_its_parts(tmp_path, monkeypatch, parts):
    tensors = PART_SETS[parts]()
    opened = _record_opens(monkeypatch)
    path = tmp_path / "data"
    write_file(path, [memoryview(t.numpy()).cast("B") for t in tensors])
    expected = b"".join(bytes(t.numpy()) for t in tensors)
    assert path.read_bytes() == expected
    if supports_direct_io(tmp_path):
        assert any(p == str(path) and flags & O_DIRECT for p, flags in opened), "not opened with O_DIRECT"


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_a_page_aligned_shard_goes_to_the_disk_from_its_own_memory(tmp_path, monkeypatch):
    if not supports_direct_io(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    shard = _aligned_bytes(64 * ALIGNMENT, 0)
    sources = []
    real_write = os.write

    def spy(fd, data):
        view = memoryview(data)
        sources.append(torch.frombuffer(view, dtype=torch.uint8).data_ptr() if view.nbytes else 0)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    write_file(tmp_path / "data", [memoryview(shard.numpy()).cast("B")])
    assert sources == [shard.data_ptr()]  # one write, from the shard itself: no copy through a buffer
    assert (tmp_path / "data").read_bytes() == bytes(shard.numpy())


def test_a_filesystem_that_refuses_o_direct_gets_a_buffered_write(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    parts = [_bytes(10_000, 0), _aligned_bytes(2 * ALIGNMENT, 1)]
    write_file(tmp_path / "data", [memoryview(t.numpy()).cast("B") for t in parts])
    assert (tmp_path / "data").read_bytes() == b"".join(bytes(t.numpy()) for t in parts)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_a_write_refused_for_its_alignment_is_done_again_buffered_from_the_start(tmp_path, monkeypatch):
    if not supports_direct_io(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    real_write = os.write
    refused = []

    def refuse_first(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_first)
    parts = [_aligned_bytes(3 * ALIGNMENT, 0), _bytes(5, 1)]
    write_file(tmp_path / "data", [memoryview(t.numpy()).cast("B") for t in parts])
    assert refused and (tmp_path / "data").read_bytes() == b"".join(bytes(t.numpy()) for t in parts)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_full_disk_or_an_io_error_is_raised_not_retried(tmp_path, monkeypatch, code):
    if not supports_direct_io(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    calls = []

    def fail(fd, data):
        calls.append(fd)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", fail)
    with pytest.raises(OSError) as raised:
        write_file(tmp_path / "data", [memoryview(_aligned_bytes(ALIGNMENT, 0).numpy()).cast("B")])
    assert raised.value.errno == code
    assert len(calls) == 1  # no second attempt through the page cache that would hide or repeat it


def test_staging_buffers_are_page_aligned():
    state = {"w": torch.randn(37, 11), "b": torch.randn(3), "i": torch.arange(5)}
    encoded = encode_state(state, None, rank=0)
    writes = regions_to_write(encoded.shared, rank=0, world_size=1, group=None)
    capture = Stager().capture(encoded, writes)
    assert capture.shards
    for shard in capture.shards:
        assert shard.data.data_ptr() % ALIGNMENT == 0, shard.key
        assert torch.equal(shard.data, state[shard.key]), shard.key


def test_snapshot_storage_writes_its_data_files_with_o_direct_and_reads_them_back(tmp_path, monkeypatch):
    opened = _record_opens(monkeypatch)
    entries = {"big": _aligned_bytes(5 * ALIGNMENT + 7, 0), **{f"s{i}": _bytes(100 + i, i) for i in range(5)}}
    storage = SnapshotStorage()
    storage.write(tmp_path / "snap", entries, group=None)
    reader = storage.reader(tmp_path / "snap")
    for name, tensor in entries.items():
        out = torch.empty_like(tensor)
        reader.read(0, name, out)
        assert torch.equal(out, tensor), name
    if supports_direct_io(tmp_path):
        data_files = [p for p, flags in opened if flags & O_DIRECT and "snap" in p]
        assert data_files, "no data file was opened with O_DIRECT"
