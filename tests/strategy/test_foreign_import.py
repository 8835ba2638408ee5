"""A run started under Lightning's DDPStrategy continues under ElasticFT3D from its `.ckpt` file, exactly."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft.checkpoint import CheckpointError, UnsafeCheckpointError
from lightning_ft.events import read_events
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log


class Activation(enum.Enum):
    TANH = "tanh"


@dataclasses.dataclass
class Widths:
    hidden: int = 16


class ConfiguredRegressor(TinyRegressor):
    """Hyperparameters of the kinds real LightningModules save, which plain ``weights_only=True`` loading refuses."""

    def __init__(self, args=None, activation=Activation.TANH, widths=None, data_dir=Path("/data"), scale=None):
        super().__init__()
        self.save_hyperparameters()


def _hparams():
    torch.manual_seed(0)  # every model of a test starts from the same weights
    return dict(
        args=argparse.Namespace(seed=3),
        activation=Activation.TANH,
        widths=Widths(),
        data_dir=Path("/data"),
        scale=np.float64(0.5),
    )


def _ddp_trainer(tmp_path, max_steps, **kwargs):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ddp", every_n_train_steps=4, save_top_k=-1)
    return make_trainer(tmp_path, strategy=DDPStrategy(), callbacks=[ckpt], max_steps=max_steps, **kwargs)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_ddp_strategy_file_continues_under_elasticft3d_as_if_uninterrupted(tmp_path):
    uninterrupted = ConfiguredRegressor(**_hparams())
    _ddp_trainer(tmp_path / "a", 8).fit(uninterrupted)

    first = ConfiguredRegressor(**_hparams())
    ddp = _ddp_trainer(tmp_path, 4)
    ddp.fit(first)
    saved = tmp_path / "ddp" / "epoch=0-step=4.ckpt"
    with pytest.raises(Exception, match="Unsupported global|weights_only"):
        torch.load(saved, weights_only=True)  # what plain safe loading says about this file

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ft", every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=4)
    resumed = ConfiguredRegressor(**_hparams())
    with pytest.warns(UserWarning, match=r"imported the Lightning \.ckpt file.*Not carried over: random") as record:
        trainer.fit(resumed, ckpt_path=str(saved))
    assert len([w for w in record if "Not carried over" in str(w.message)]) == 1
    assert trainer.global_step == 4
    for k, v in _weights(first).items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == ddp.lr_scheduler_configs[0].scheduler.last_epoch
    restored_opt = trainer.optimizers[0].state_dict()["state"]
    for pid, values in ddp.optimizers[0].state_dict()["state"].items():
        for name, t in values.items():
            assert torch.equal(restored_opt[pid][name], t), (pid, name)

    # Mid-epoch (4 of 16 batches): the sampler continues where DDPStrategy's DistributedSampler stood, so the weights
    # after 8 steps equal an uninterrupted DDPStrategy run's bitwise.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ft", every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=8)
    continued = ConfiguredRegressor(**_hparams())
    trainer.fit(continued, ckpt_path=str(saved))
    for k, v in _weights(uninterrupted).items():
        assert torch.equal(continued.state_dict()[k], v), k
    assert continued.hparams.activation is Activation.TANH and continued.hparams.widths == Widths()


def test_auto_resume_finds_a_ddp_strategy_file_in_the_checkpoint_folder(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    make_trainer(tmp_path, strategy=DDPStrategy(), callbacks=[ckpt], max_steps=4).fit(TinyRegressor())
    assert (tmp_path / "ckpt" / "epoch=0-step=4.ckpt").is_file()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=6)
    with pytest.warns(UserWarning, match="imported the Lightning .ckpt file"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 6
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [(e["step"], Path(e["path"]).name) for e in resumed] == [(4, "epoch=0-step=4.ckpt")]
    as_a_new_process()  # the relaunch
    # Once ElasticFT3D has committed a newer checkpoint, that one is chosen over the foreign files.
    trainer = make_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")], max_steps=6)
    trainer.fit(TinyRegressor())
    assert Path([e for e in read_events(tmp_path) if e["event"] == "resumed"][-1]["path"]).name == "epoch=0-step=6.ckpt"


class _Opaque:
    """A class no allowlist knows."""


def test_a_file_needing_an_unknown_class_is_refused_naming_it_and_how_to_allow_it(tmp_path):
    path = tmp_path / "custom.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "hyper_parameters": {"x": _Opaque()}}, path)
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(UnsafeCheckpointError, match=r"test_foreign_import\._Opaque.*safe_globals\(\["):
        trainer.fit(TinyRegressor(), ckpt_path=str(path))
    # The documented way to allow it: the user's own scoped context around the call.
    with torch.serialization.safe_globals([_Opaque]):
        trainer = make_trainer(tmp_path, max_steps=1)
        with pytest.raises(RuntimeError, match="Missing key"):  # now it loads, and Lightning checks the weights
            trainer.fit(TinyRegressor(), ckpt_path=str(path))
    # Nothing stays allowed after the load: neither the user's class nor lightning-ft's defaults.
    assert not {_Opaque, argparse.Namespace, Path} & set(torch.serialization.get_safe_globals())


def test_a_pickle_that_is_not_a_torch_save_file_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "legacy.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": {}}))
    with pytest.raises(CheckpointError):
        make_trainer(tmp_path, max_steps=1).fit(TinyRegressor(), ckpt_path=str(path))


def test_ddp_file_to_elasticft3d_and_back_through_export_to_ddp_strategy(tmp_path):
    from lightning_ft.cli import main

    ddp = _ddp_trainer(tmp_path, 4)
    ddp.fit(ConfiguredRegressor(**_hparams()))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ft", every_n_train_steps=2, save_top_k=-1)
    ft = make_trainer(tmp_path, callbacks=[ckpt], max_steps=6)
    model = ConfiguredRegressor(**_hparams())
    ft.fit(model, ckpt_path=str(tmp_path / "ddp" / "epoch=0-step=4.ckpt"))
    out = tmp_path / "exported.ckpt"
    assert main(["export", "--full", "--no-progress", str(tmp_path / "ft" / "epoch=0-step=6.ckpt"), str(out)]) == 0

    plain = torch.load(out, weights_only=True, mmap=True)  # plain PyTorch, nothing allowed beyond its defaults
    assert plain["global_step"] == 6 and plain["hyper_parameters"]["activation"] == "tanh"
    assert not any(k.startswith("lightning_ft") for k in plain["callbacks"])
    assert ConfiguredRegressor.load_from_checkpoint(out, weights_only=True).hparams.widths == {"hidden": 16}

    back = _ddp_trainer(tmp_path / "back", 6)
    restored = ConfiguredRegressor(**_hparams())
    back.fit(restored, ckpt_path=str(out))  # resumes at step 6 == max_steps: restores and stops
    assert back.global_step == 6
    for k, v in _weights(model).items():
        assert torch.equal(restored.state_dict()[k], v), k
    expected_opt = ft.optimizers[0].state_dict()
    got_opt = back.optimizers[0].state_dict()
    assert got_opt["param_groups"] == expected_opt["param_groups"]
    for pid, values in expected_opt["state"].items():
        for name, t in values.items():
            assert torch.equal(got_opt["state"][pid][name], t), (pid, name)
    assert back.lr_scheduler_configs[0].scheduler.state_dict() == ft.lr_scheduler_configs[0].scheduler.state_dict()
    _ddp_trainer(tmp_path / "back", 8).fit(ConfiguredRegressor(**_hparams()), ckpt_path=str(out))  # and trains on
