"""``lightning_ft.load_from_checkpoint``: a checkpoint a Trainer wrote, into a LightningModule for inference, in one
line and one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D, load_from_checkpoint
from lightning_ft.checkpoint import CheckpointNotFoundError, UncommittedCheckpointError
from lightning_ft.checkpoint.in_progress import discard
from lightning_ft.checkpoint.internal import COMMIT_MARKER
from tests.helpers import run_distributed
from tests.strategy.conftest import _release_lightning_process_group  # noqa: F401 - autouse in this module too
from tests.strategy.models import TinyRegressor, make_trainer


class ShardedRegressor(TinyRegressor):
    """The same layers, sharded with FSDP2 over the data-parallel axis: its parameters are DTensors."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def _train(tmp_path, model, steps=4, checkpoint_format="auto"):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    strategy = ElasticFT3D(checkpoint_format=checkpoint_format)
    make_trainer(tmp_path, strategy=strategy, callbacks=[ckpt], max_steps=steps).fit(model)
    return tmp_path / "ckpt"


def _full(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}


def test_a_class_is_built_from_the_saved_hyperparameters_and_returned_in_eval_mode(tmp_path):
    trained = TinyRegressor(lr=0.03)
    folder = _train(tmp_path, trained)
    if dist.is_initialized():  # Lightning keeps its group after fit; a plain inference process has none
        dist.destroy_process_group()

    model = load_from_checkpoint(TinyRegressor, folder / "last.ckpt")
    assert type(model) is TinyRegressor and not model.training
    assert model.hparams.lr == 0.03
    for key, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key

    older = load_from_checkpoint(TinyRegressor, folder / "epoch=0-step=2.ckpt", lr=0.5)
    assert older.hparams.lr == 0.5
    assert not torch.equal(older.state_dict()["net.0.weight"], trained.state_dict()["net.0.weight"])


def test_an_instance_gets_the_weights_in_place(tmp_path):
    trained = TinyRegressor()
    folder = _train(tmp_path, trained)
    target = TinyRegressor()
    assert load_from_checkpoint(target, folder / "last.ckpt") is target and not target.training
    assert torch.equal(target.state_dict()["net.2.bias"], trained.state_dict()["net.2.bias"])
    with pytest.raises(TypeError, match="pass the class TinyRegressor instead"):
        load_from_checkpoint(TinyRegressor(), folder / "last.ckpt", lr=0.5)


def test_a_sharded_dtensor_checkpoint_loads_into_the_plain_module(tmp_path):
    trained = ShardedRegressor()
    folder = _train(tmp_path, trained)
    full = _full(trained)
    assert any(hasattr(v, "full_tensor") for v in trained.state_dict().values())
    model = load_from_checkpoint(TinyRegressor, folder / "last.ckpt")
    assert set(model.state_dict()) == set(full)
    for key, value in full.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_an_uncommitted_last_link_and_a_missing_path_are_refused(tmp_path):
    folder = _train(tmp_path, TinyRegressor(), checkpoint_format="torchsnapshot")
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as raised:
        load_from_checkpoint(TinyRegressor, folder / "epoch=0-step=9.ckpt")
    assert isinstance(raised.value, FileNotFoundError)
    # Lightning's save_last="link" link to a checkpoint whose commit marker is gone.
    discard(folder / "last.ckpt")
    os.symlink("epoch=0-step=4.ckpt", folder / "last.ckpt")
    (folder / "last.ckpt").resolve().joinpath(COMMIT_MARKER).unlink()
    with pytest.raises(UncommittedCheckpointError, match=r"last\.ckpt points at .*step=4\.ckpt.*not committed"):
        load_from_checkpoint(TinyRegressor, folder / "last.ckpt")


def _only_rank_zero_loads(rank, world_size, folder, out):
    if rank == 0:
        model = load_from_checkpoint(TinyRegressor, f"{folder}/last.ckpt")
        torch.save(model.state_dict(), out)
    dist.barrier()


def test_any_single_rank_may_load_while_the_others_do_not(tmp_path):
    trained = TinyRegressor()
    folder = _train(tmp_path, trained)
    if dist.is_initialized():
        dist.destroy_process_group()
    out = tmp_path / "loaded.pt"
    run_distributed(_only_rank_zero_loads, 2, str(folder), str(out), timeout_s=120)
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in trained.state_dict().items())
