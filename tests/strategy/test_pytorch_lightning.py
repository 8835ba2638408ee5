"""lightning-ft in a project that imports the standalone ``pytorch_lightning`` package: the strategy and the monitors
from :mod:`lightning_ft.pytorch_lightning`, by object and by name, a fit with a ModelCheckpoint and an exact resume."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import REPO_ROOT, subprocess_env

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
        g = torch.Generator().manual_seed(0)  # not tests.strategy.models: it imports the lightning package
        return DataLoader(
            TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=4, shuffle=True
        )


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


_PL_ONLY = """
import sys

import pytorch_lightning as pl

from lightning_ft.pytorch_lightning import ElasticFT3D, StragglerMonitor
from tests.strategy.test_pytorch_lightning import PlRegressor

trainer = pl.Trainer(
    accelerator="cpu", devices=1, strategy=ElasticFT3D(), max_steps=2, default_root_dir=sys.argv[1], logger=False,
    enable_progress_bar=False, callbacks=[StragglerMonitor(), pl.callbacks.ModelCheckpoint(dirpath=sys.argv[1])],
)
trainer.fit(PlRegressor())
print(trainer.global_step, sorted(m for m in sys.modules if m == "lightning" or m.startswith("lightning.")))
"""


def test_a_pytorch_lightning_run_never_imports_the_lightning_package(tmp_path):
    # Every class the strategy checks against is pytorch_lightning's: nothing of lightning.pytorch is even loaded.
    proc = subprocess.run(
        [sys.executable, "-c", _PL_ONLY, str(tmp_path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "2 []"


def test_the_pytorch_lightning_namespace_offers_the_names_lightning_ft_offers():
    import lightning_ft
    import lightning_ft.pytorch_lightning as ftpl

    assert ftpl.__all__ == lightning_ft.__all__
