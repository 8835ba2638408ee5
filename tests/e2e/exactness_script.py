"""A run with per-rank state and randomness in the data pipeline, for the exact-resume tests under real torchrun.

BatchNorm keeps running statistics that differ between data-parallel ranks; the dataset draws random numbers in
``__getitem__`` (torch, numpy and Python's ``random``); two training loaders of different lengths are combined in a
dict (the shorter one is cycled within the epoch). Every rank writes its own final state (buffers included) and the
losses of its own batches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, ReplicaGroups  # noqa: E402


class Augmented(Dataset):
    def __init__(self, n: int, dim: int = 6, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(offset)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.rand(self.x.shape[1]) * 0.1 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[i] + noise, self.y[i]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        loss = sum(nn.functional.mse_loss(self.net(x), y) for x, y in batch.values())
        self.losses[self.global_step + 1] = float(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class HardExitAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_wait()
            os._exit(17)


def replica_groups(min_replicas: int) -> ReplicaGroups | None:
    """As train_script.py's: ``ReplicaGroups(min_replicas=...)`` bound to 127.0.0.1 (the lighthouse and the id from
    the environment), or ``None`` for 0."""
    if not min_replicas:
        return None
    from datetime import timedelta

    return ReplicaGroups(address="127.0.0.1", min_replicas=min_replicas, timeout=timedelta(seconds=5))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--data-randomness", default="ddp", help="ElasticFT3D(data_randomness=...)")
    p.add_argument(
        "--replica-groups", type=int, default=0, help="N: the fit is a replica group, min_replicas=N (train_script.py)"
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(7)
    root = Path(args.root)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1)
    ]
    if args.kill_at_step:
        callbacks.append(HardExitAt(args.kill_at_step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(data_randomness=args.data_randomness, replica_groups=replica_groups(args.replica_groups)),
        max_steps=args.max_steps,
        default_root_dir=root,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Net()
    loaders = {
        "a": DataLoader(Augmented(96), batch_size=4, shuffle=True, num_workers=args.num_workers),
        "b": DataLoader(Augmented(40, offset=1), batch_size=4, shuffle=True, num_workers=args.num_workers),
    }
    trainer.fit(model, train_dataloaders=loaders)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"state_rank{rank}.pt")
    losses_file = out / f"losses_rank{rank}.json"
    previous = json.loads(losses_file.read_text()) if losses_file.exists() else {}
    previous.update({str(k): v for k, v in model.losses.items()})
    losses_file.write_text(json.dumps(previous))


if __name__ == "__main__":
    main()
