"""One experiment for tests/e2e/test_resume_identity.py, under torchrun or plain ``python`` (one process).

``--strategy ddp`` runs the same script under Lightning's ``DDPStrategy`` (the oracle). ``--hidden`` is the width of
the model's hidden layer (another width: another experiment); ``--crash-at`` raises in the first attempt (torchrun's
restart count 0) after that step; ``--hold-file`` pauses after step ``--hold-step`` while the file exists;
``--ckpt-path`` is passed to ``fit``; ``--samples`` is the dataset's length (4 a batch). Every rank writes its final
weights to ``<out>/weights_rank<r>.pt``, rank 0 also ``<out>/run.json`` (``trainer.ckpt_path``, the final step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, FaultPolicy, MemoryTier  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


class HoldAfter(Callback):
    def __init__(self, file: str, step: int) -> None:
        self.file, self.step = file, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        while self.file and trainer.global_step >= self.step and os.path.exists(self.file):
            time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ft", "ddp"], default="ft")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--memory-every", type=int, default=0, help="0: no memory tier")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--hold-file", default="")
    p.add_argument("--hold-step", type=int, default=0)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--samples", type=int, default=128)
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(1234)
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy()
    else:
        tier = MemoryTier(every_n_train_steps=args.memory_every) if args.memory_every else None
        strategy = ElasticFT3D(fault=FaultPolicy(health_checks=False), memory_tier=tier)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=args.ckpt_every, save_top_k=-1),
        CrashAt(args.crash_at),
        HoldAfter(args.hold_file, args.hold_step),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 8, generator=g), torch.randn(args.samples, 1, generator=g))
    model = Regressor(args.hidden, args.lr)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4, shuffle=True), ckpt_path=args.ckpt_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights_rank{trainer.global_rank}.pt"
    )
    if trainer.global_rank == 0:
        (out / "run.json").write_text(
            json.dumps({"ckpt_path": trainer.ckpt_path and str(trainer.ckpt_path), "step": trainer.global_step})
        )


if __name__ == "__main__":
    main()
