"""torchsnapshot batches small entries into one file; we hand it the entries' own bytes instead of a copied slab."""

from __future__ import annotations

import torch
from torchsnapshot.batcher import BatchedBufferStager

from lightning_ft import _compat
from lightning_ft.checkpoint.internal import SnapshotStorage
from lightning_ft.checkpoint.snapshot_storage import _DurableFSPlugin


def test_a_batch_of_small_entries_is_written_as_one_file_from_their_own_bytes_and_reads_back_exactly(
    tmp_path, monkeypatch
):
    written = []
    write_sync = _DurableFSPlugin._write_sync

    def spy(self, write_io):
        written.append(write_io.buf)
        write_sync(self, write_io)

    monkeypatch.setattr(_DurableFSPlugin, "_write_sync", spy)
    generator = torch.Generator().manual_seed(0)
    entries = {
        f"t{i}": torch.randint(0, 256, (1000 + 37 * i,), dtype=torch.uint8, generator=generator) for i in range(50)
    }
    original_stage = BatchedBufferStager.stage_buffer
    storage = SnapshotStorage()
    storage.write(tmp_path / "snap", entries, group=None)

    assert BatchedBufferStager.stage_buffer is original_stage  # the patch is undone after the write
    total = sum(t.numel() for t in entries.values())
    [batch] = [buf for buf in written if len(buf) == total]  # the other write is torchsnapshot's manifest
    # Not copied into a slab: the parts are the entries' own memory.
    assert isinstance(batch, _compat.GatheredBuffer) and len(batch.parts) == len(entries)
    pointers = {t.data_ptr() for t in entries.values()}
    assert all(torch.frombuffer(part, dtype=torch.uint8).data_ptr() in pointers for part in batch.parts)
    files = [p for p in (tmp_path / "snap").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(files) == 1  # every entry in one batch file, written in order
    assert files[0].stat().st_size == total
    reader = storage.reader(tmp_path / "snap")
    for name, tensor in entries.items():
        out = torch.empty_like(tensor)
        reader.read(0, name, out)
        assert torch.equal(out, tensor), name
