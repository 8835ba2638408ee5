"""A small run under real torchrun in which one rank stops for good at one step, for the hang-naming tests.

``--stuck`` says where rank ``--rank`` stops at step ``--step`` (a checkpoint step: ``ModelCheckpoint`` saves every 2
steps): ``callback`` (a user callback's ``on_train_batch_end``, while the other ranks wait in the save's collectives
in the same hook), ``data`` (a data read that never returns), ``compute`` (a loop in ``training_step`` without any
collective), ``collective`` (an ``all_reduce`` on a group the other ranks never call). The watchdog
(``FaultPolicy(hang_timeout_s=...)``) ends every rank and each writes a ``hang`` event.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, FaultPolicy  # noqa: E402

FOREVER_S = 3600.0


def _stop_forever() -> None:
    deadline = time.monotonic() + FOREVER_S
    while time.monotonic() < deadline:
        time.sleep(0.5)


class Where:
    def __init__(self, stuck: str, rank: int, step: int) -> None:
        self.stuck, self.rank, self.step = stuck, rank, step
        self.global_step = 0

    def here(self, stuck: str) -> bool:
        return self.stuck == stuck and int(os.environ["RANK"]) == self.rank and self.global_step == self.step


class Samples(Dataset):
    def __init__(self, where: Where, n: int = 512) -> None:
        self.where = where
        self.x = torch.randn(n, 8)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.where.here("data"):
            _stop_forever()
        return self.x[index]


class Model(L.LightningModule):
    def __init__(self, where: Where) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.where = where
        self.side_group = None

    def setup(self, stage: str) -> None:
        # Created by every rank (new_group is collective); only the stuck rank ever calls into it.
        self.side_group = dist.new_group(backend="gloo")

    def training_step(self, batch, batch_idx):
        if self.where.here("compute"):
            x = torch.ones(4)
            deadline = time.monotonic() + FOREVER_S
            while time.monotonic() < deadline:
                x = x * 1.0000001
        if self.where.here("collective"):
            dist.all_reduce(torch.ones(1), group=self.side_group)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopInCallback(Callback):
    def __init__(self, where: Where) -> None:
        self.where = where

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.where.global_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.where.global_step = trainer.global_step
        if self.where.here("callback"):
            _stop_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--stuck", choices=["callback", "data", "compute", "collective"], required=True)
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--step", type=int, default=4)
    p.add_argument("--hang-timeout", type=float, default=20.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    root = Path(args.root)
    # One record of the step, kept by the callback: the data read that stops is the first one after the batch end
    # that reached step `--step` (Lightning fetches a batch ahead).
    where = Where(args.stuck, args.rank, args.step)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(
            fault=FaultPolicy(hang_timeout_s=args.hang_timeout, first_step_timeout_s=300.0, health_checks=False)
        ),
        max_steps=args.step + 4,
        default_root_dir=root,
        logger=False,
        callbacks=[StopInCallback(where), ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(Model(where), DataLoader(Samples(where), batch_size=4))


if __name__ == "__main__":
    main()
