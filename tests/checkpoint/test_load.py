"""Loading refuses what is not committed, damaged or unsafe, naming the tensor and the file; every rank agrees."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ft.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
    load_checkpoint,
    verify,
)
from tests.checkpoint.support import (
    CreatesFileWhenUnpickled,
    data_files,
    folders_only,
    plant_pickled_entry,
    save,
    uncommitted,
)
from tests.helpers import run_distributed

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def test_loading_an_uncommitted_checkpoint_is_refused_naming_the_newest_committed_one(tmp_path):
    folders_only()
    save(tmp_path / "step=10", 10)
    uncommitted(tmp_path / "step=20", 20)
    with pytest.raises(UncommittedCheckpointError) as raised:
        load_checkpoint(tmp_path / "step=20")
    assert str(tmp_path / "step=20") in str(raised.value)
    assert str(tmp_path / "step=10") in str(raised.value)
    with pytest.raises(UncommittedCheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step=30")


def test_a_corrupted_byte_in_a_shard_file_is_named_by_load_and_verify(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1, {"model": {"weight": torch.randn(512, 512), "bias": torch.randn(8)}})
    target = data_files(path)[-1]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    relative = str(target.relative_to(path))
    with pytest.raises(CorruptCheckpointError) as raised:
        load_checkpoint(path)
    assert "model/weight" in str(raised.value) and relative in str(raised.value)
    problems = verify(path)
    assert len(problems) == 1 and "model/weight" in problems[0] and "checksum" in problems[0]
    assert load_checkpoint(path, verify_checksums=False).state["model"]["bias"].shape == (8,)


def test_a_missing_shard_file_is_named(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1, {"model": {"weight": torch.randn(512, 512)}})
    target = data_files(path)[-1]
    target.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing") as raised:
        load_checkpoint(path)
    assert "model/weight" in str(raised.value) and str(target.relative_to(path)) in str(raised.value)
    assert any("model/weight" in p for p in verify(path))


def test_a_shard_file_replaced_by_a_pickle_is_refused_without_unpickling(tmp_path):
    folders_only()
    path = save(tmp_path / "c", 1, {"weight": torch.randn(64, 64)})
    sentinel = tmp_path / "pwned"
    data_files(path)[-1].write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    with pytest.raises(CorruptCheckpointError, match="weight"):
        load_checkpoint(path)
    assert not sentinel.exists()


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot"], indirect=True)
def test_a_planted_torchsnapshot_object_entry_is_refused_without_unpickling(tmp_path):
    path = save(tmp_path / "c", 1)
    sentinel = tmp_path / "pwned"
    plant_pickled_entry(path, CreatesFileWhenUnpickled(sentinel))
    with pytest.raises(UnsafeCheckpointError, match="0/shards/evil"):
        load_checkpoint(path)
    assert any("pickled" in p for p in verify(path))
    assert not sentinel.exists()


@pytest.mark.parametrize("checkpoint_format", ["dcp"], indirect=True)
def test_a_pickle_planted_as_dcps_own_metadata_is_never_unpickled(tmp_path):
    path = save(tmp_path / "c", 1, {"weight": torch.arange(16.0)})
    sentinel = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(CreatesFileWhenUnpickled(sentinel)))
    # lightning-ft reads its own entry table and the raw storage bytes; DCP's pickled metadata is left unread.
    assert torch.equal(load_checkpoint(path).state["weight"], torch.arange(16.0))
    assert verify(path) == []
    assert not sentinel.exists()


def _one_rank_cannot_load(rank: int, world_size: int, root: str) -> None:
    path = Path(root) / "c"
    # Rank 1's template does not match the checkpoint; rank 0's does, and must not go on with a state rank 1 lacks.
    template = {"w": torch.zeros(4 if rank == 0 else 5)}
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, template)
    message = str(raised.value)
    if rank == 1:
        assert "has shape [4] in the checkpoint but [5]" in message and str(path) in message
    else:
        assert type(raised.value) is CheckpointError
        assert message.startswith("loading failed on rank 1: CheckpointError:") and "[5]" in message
    dist.barrier()


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot"], indirect=True)  # two processes: one format
def test_a_load_that_fails_on_one_rank_raises_on_every_rank_naming_the_failing_rank(tmp_path):
    save(tmp_path / "c", 1)
    run_distributed(_one_rank_cannot_load, 2, str(tmp_path))
