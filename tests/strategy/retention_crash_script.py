"""A Lightning script that is SIGKILLed while the checkpoint replacing a top-k one is being written, under
``DDPStrategy`` or ``ElasticFT3D`` (one process):

    python tests/strategy/retention_crash_script.py --strategy ddp|elastic --root DIR

``ModelCheckpoint(monitor="score", mode="min", save_top_k=1, save_last=True, every_n_train_steps=2)`` with a score
that improves every step: at step 2 the top-k file and ``last.ckpt``; at step 4 Lightning asks for the new top-k file,
then deletes the step-2 one, then writes ``last.ckpt``. From step 4 on every checkpoint write takes ``--slow-write-s``
(a slow disk, under either strategy: Lightning's synchronous ``TorchCheckpointIO`` or lightning-ft's background
writer), and the process SIGKILLs itself after step 5. ``tests/strategy/test_retention_crash.py`` looks at what is
left.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SLOW = {"seconds": 0.0}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("score", -float(self.global_step))  # better every step: each top-k save replaces the previous
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Crash(L.Callback):
    """Before step 4: waits until the step-2 checkpoints are readable files, then slows every later write. After step
    5: SIGKILL."""

    def __init__(self, dirpath: Path, slow_s: float) -> None:
        self.dirpath = dirpath
        self.slow_s = slow_s

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step != 3:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if all(
                    torch.load(self.dirpath / name, weights_only=True)["global_step"] == 2
                    for name in ("epoch=0-step=2.ckpt", "last.ckpt")
                ):
                    break
            except Exception:  # noqa: BLE001 - not written yet
                pass
            time.sleep(0.05)
        SLOW["seconds"] = self.slow_s

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)


def _slow_disk() -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_ft.checkpoint.single_file import FileStorage
    from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

    def slowed(write: Any) -> Any:
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(SLOW["seconds"])
            return write(*args, **kwargs)

        return slow

    for cls, name in ((TorchCheckpointIO, "save_checkpoint"), (FileStorage, "write"), (SnapshotStorage, "write")):
        setattr(cls, name, slowed(getattr(cls, name)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "elastic"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--slow-write-s", type=float, default=2.0)
    args = parser.parse_args()
    _slow_disk()
    root = Path(args.root)
    torch.manual_seed(0)
    if args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy()
    else:
        from lightning_ft import ElasticFT3D

        strategy = ElasticFT3D()
    dirpath = root / "ckpt"
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=8,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=dirpath, monitor="score", mode="min", save_top_k=1, save_last=True, every_n_train_steps=2
            ),
            Crash(dirpath, args.slow_write_s),
        ],
    )
    trainer.fit(Model(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
