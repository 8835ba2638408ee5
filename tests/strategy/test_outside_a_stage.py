"""What ``ElasticFT3D`` answers on a ``Trainer`` that has not started ``fit``/``validate``/``test``/``predict``: the
questions ``DDPStrategy`` answers there too (Lightning's own tests ask them), found by running Lightning's tests
(benchmarks/lightning_compat.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint.discovery import is_committed
from lightning_ft.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from lightning_ft.checkpoint.location import is_lightning_ft_checkpoint
from tests.checkpoint.support import CreatesFileWhenUnpickled
from tests.strategy.models import TinyRegressor, make_trainer


def test_sampler_arguments_before_the_mesh_exists_are_those_of_ddp(tmp_path):
    trainer = make_trainer(tmp_path)
    # Lightning reads them when it prepares a loader outside a stage (a loop's setup_data()).
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_sampler_arguments_with_tensor_parallelism_need_the_mesh(tmp_path):
    # The data-parallel group is then a part of the world that only the mesh knows.
    strategy = ElasticFT3D(tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="device mesh before processes have initialized"):
        strategy.distributed_sampler_kwargs  # noqa: B018 - the property is what is tested


# ---------------------------------------------------------------- saves and loads before any stage


def _connected(root, **strategy_kwargs):
    """A Trainer whose strategy holds a module but never started a stage (no process group, no mesh)."""
    torch.manual_seed(0)
    trainer = make_trainer(root, strategy=ElasticFT3D(**strategy_kwargs))
    model = TinyRegressor()
    trainer.strategy.connect(model)
    return trainer, model


def _flip_a_byte_of(path, value):
    """Flip one byte inside the stored bytes of tensor ``value`` in checkpoint file ``path``."""
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("fmt", ["auto", "torchsnapshot"])
def test_a_save_before_any_stage_is_committed_and_loads_back(tmp_path, fmt):
    trainer, model = _connected(tmp_path, checkpoint_format=fmt)
    path = tmp_path / "ckpt" / "before.ckpt"
    trainer.save_checkpoint(path)
    assert is_lightning_ft_checkpoint(path) and is_committed(path)
    assert path.is_file() == (fmt == "auto")  # one process: the file Lightning writes; or a folder when asked
    if fmt == "auto":
        assert torch.load(path, weights_only=True)["state_dict"].keys() == model.state_dict().keys()
    assert not [p for p in path.parent.iterdir() if p != path]  # no staging leftovers

    # Lightning's checkpoint connector, on a second Trainer that never started a stage either.
    other, fresh = _connected(tmp_path / "other", checkpoint_format=fmt)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    other._checkpoint_connector.resume_start(str(path))
    other._checkpoint_connector.restore_model()
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_a_load_before_any_stage_checks_the_checksums(tmp_path):
    trainer, model = _connected(tmp_path)
    path = tmp_path / "damaged.ckpt"
    trainer.save_checkpoint(path)
    _flip_a_byte_of(path, model.net[0].weight)
    assert torch.load(path, weights_only=True)["global_step"] == 0  # torch.load checks no checksum
    other, _ = _connected(tmp_path / "other")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*net.0.weight"):
        other._checkpoint_connector.resume_start(str(path))


def test_a_lightning_file_before_any_stage_is_read_without_unpickling(tmp_path):
    trainer, model = _connected(tmp_path)
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "global_step": 3}, plain)
    assert trainer.strategy.load_checkpoint(plain)["global_step"] == 3
    hostile = tmp_path / "hostile.ckpt"
    torch.save({"state_dict": {}, "payload": CreatesFileWhenUnpickled(tmp_path / "ran")}, hostile)
    with pytest.raises(UnsafeCheckpointError):
        trainer.strategy.load_checkpoint(hostile)
    assert not (tmp_path / "ran").exists()


def test_a_save_before_any_stage_in_a_world_of_two_is_refused(tmp_path, monkeypatch):
    trainer, _ = _connected(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched by torchrun with 2 processes, before fit sets up the group
    with pytest.raises(RuntimeError, match="world of 2 processes"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(RuntimeError, match="world of 2 processes"):
        trainer.strategy.load_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def test_a_save_before_any_stage_with_tensor_parallelism_is_refused(tmp_path):
    trainer, _ = _connected(tmp_path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
