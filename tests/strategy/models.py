"""Tiny modules and trainer factories for the strategy tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RandomVectors(Dataset):
    def __init__(self, n: int = 64, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class TinyRegressor(L.LightningModule):
    def __init__(self, dim: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1))

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


def make_trainer(root: Path, *, strategy: Any = None, callbacks: list | None = None, **kwargs: Any) -> L.Trainer:
    from lightning_ft import ElasticFT3D

    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        strategy=strategy if strategy is not None else ElasticFT3D(),
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks or [],
        log_every_n_steps=1,
    )
    options.update(kwargs)
    return L.Trainer(**options)
