"""A dataset that augments with the global RNGs, a model with dropout, and the runs the data-randomness tests compare.

Imported by the in-process tests (``tests/elastic/test_data_randomness.py``) and run under torchrun as a script by
``tests/e2e/test_ddp_equivalence.py``: ``python -m torch.distributed.run ... data_randomness.py --strategy ddp
--out DIR`` writes rank 0's final weights to ``DIR/weights.pt``.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_ft.strategy.run_identity import forget_folders_used


class Augmented(Dataset):
    """Fixed points plus noise drawn in ``__getitem__`` from torch's, numpy's and Python's global RNGs."""

    def __init__(self, n: int = 40, dim: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(self.x.shape[1]) * 0.1 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[i] + noise, self.y[i]


class Net(L.LightningModule):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pairs = batch.values() if isinstance(batch, dict) else [batch]  # several training loaders: a dict
        loss = sum(nn.functional.mse_loss(self.net(x), y) for x, y in pairs)
        self.losses[self.global_step + 1] = float(loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(
    root: Path,
    *,
    strategy: Any,
    max_steps: int,
    loader: DataLoader | None = None,
    num_workers: int = 0,
    ckpt_every: int = 0,
    devices: int = 1,
    callbacks: list[Callback] | None = None,
    **trainer_kwargs: Any,
) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Seed, build and fit one Trainer (a launch: what this process saved before does not count as its own); returns
    the final weights and the loss of every step it trained."""
    forget_folders_used()
    L.seed_everything(0, verbose=False)
    callbacks = list(callbacks or [])
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(ckpt_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    model = Net()
    if loader is None:
        loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=num_workers)
    env = dict(os.environ)
    trainer.fit(model, train_dataloaders=loader)
    if devices == 1 and torch.distributed.is_initialized():
        # DDPStrategy in this process leaves its one-rank group and its variables behind; ElasticFT3D does not.
        torch.distributed.destroy_process_group()
        for key in set(os.environ) - set(env):
            del os.environ[key]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "elasticft"], required=True)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.strategy == "elasticft":
        from lightning_ft import ElasticFT3D

        strategy: Any = ElasticFT3D()
    else:
        strategy = "ddp"
    out = Path(args.out)
    weights, _ = fit(
        out / "root",
        strategy=strategy,
        max_steps=args.max_steps,
        num_workers=args.num_workers,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
    )
    if int(os.environ["RANK"]) == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
