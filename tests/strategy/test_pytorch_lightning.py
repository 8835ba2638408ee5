"""lightning-ft in a project that imports the standalone ``pytorch_lightning`` package: the strategy and the monitors
from :mod:`lightning_ft.pytorch_lightning`, by object and by name, a fit with a ModelCheckpoint and an exact resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.strategy.models import RandomVectors

pl = pytest.importorskip("pytorch_lightning")

from lightning_ft.pytorch_lightning import ElasticFT3D, GoodputMonitor, StragglerMonitor  # noqa: E402


class PlRegressor(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomVectors(), batch_size=4, shuffle=True)


def _trainer(root, *, max_steps: int, checkpoints=None) -> pl.Trainer:
    callbacks = [StragglerMonitor(), GoodputMonitor()]
    if checkpoints is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_last=True))
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticFT3D(),
        default_root_dir=root,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        log_every_n_steps=1,
    )


def _fit(root, *, max_steps: int, checkpoints=None, ckpt_path=None) -> PlRegressor:
    pl.seed_everything(7)
    model = PlRegressor()
    _trainer(root, max_steps=max_steps, checkpoints=checkpoints).fit(model, ckpt_path=ckpt_path)
    return model


def test_the_pytorch_lightning_build_is_built_on_pytorch_lightnings_bases():
    assert isinstance(ElasticFT3D(), pl.strategies.Strategy)
    assert isinstance(StragglerMonitor(), pl.Callback) and isinstance(GoodputMonitor(), pl.Callback)


def test_a_pytorch_lightning_trainer_takes_the_strategy_by_name():
    trainer = pl.Trainer(strategy="elastic_ft3d", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is ElasticFT3D


def test_a_pytorch_lightning_fit_resumes_from_its_checkpoint_exactly(tmp_path):
    whole = _fit(tmp_path / "whole", max_steps=8)
    _fit(tmp_path / "run", max_steps=4, checkpoints=tmp_path / "run" / "checkpoints")
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    resumed = _fit(tmp_path / "run", max_steps=8, checkpoints=tmp_path / "run" / "checkpoints", ckpt_path="last")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
