"""One Lightning script, run under ``DDPStrategy`` or ``ElasticFT3D`` (one process, or several under torchrun), that
records what a user can observe of checkpoint names: the files at every checkpoint path, the callback's paths, and
what a checkpoint-uploading logger (WandbLogger/MLFlowLogger/NeptuneLogger with ``log_model="all"``) would upload.

    python tests/strategy/names_script.py --strategy ddp|elastic --root DIR [--save-last true|link|false]
        [--filename model] [--every 2] [--max-steps 8] [--devices 1] [--slow-write-s 0.5]

``--slow-write-s`` makes every checkpoint write that long (a slow disk), under either strategy: Lightning's
``TorchCheckpointIO`` (synchronous) or lightning-ft's background writer, whose save is then still in flight when
Lightning computes the next name.

Rank 0 writes ``DIR/observed.json`` (see :func:`observe`). ``tests/strategy/test_checkpoint_names.py`` compares the
two strategies' observations.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers.utilities import _scan_checkpoints
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Vectors(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Model(L.LightningModule):
    """Logs ``score``: a value per step that goes up and down, so every save is kept by ``save_top_k=-1`` and the best
    is not the newest."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        step = self.global_step
        self.log("score", float((step * 7) % 5), sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Vectors(), batch_size=4)


def _describe(path: str) -> dict[str, Any]:
    """What a user finds at ``path``: kind, and for a file whether torch.load reads it and its global step."""
    p = Path(path)
    if p.is_symlink():
        kind = "link"
    elif p.is_file():
        kind = "file"
    elif p.is_dir():
        kind = "folder"
    else:
        return {"kind": "missing"}
    out: dict[str, Any] = {"kind": kind}
    if p.is_file():
        try:
            loaded = torch.load(p, map_location="cpu", weights_only=True)
            out["weights_only_load"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded: DDP's file is the oracle
            out["weights_only_load"] = type(e).__name__
            try:
                loaded = torch.load(p, map_location="cpu", weights_only=False)
            except Exception as e2:  # noqa: BLE001
                out["load"] = type(e2).__name__
                return out
        out["global_step"] = loaded.get("global_step")
        out["has_optimizer"] = "optimizer_states" in loaded
        out["link_target"] = None
    if kind == "link":
        out["link_target"] = os.readlink(p)
    return out


class UploadRecorder(Logger):
    """A logger that uploads checkpoints the way WandbLogger(log_model="all") does: at every ``after_save_checkpoint``
    it runs Lightning's ``_scan_checkpoints`` and "uploads" (records) each path it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.logged_model_time: dict[str, float] = {}
        self.uploads: list[dict[str, Any]] = []
        self.calls = 0

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.calls += 1
        for t, p, _score, tag in _scan_checkpoints(checkpoint_callback, self.logged_model_time):
            self.uploads.append({"name": Path(p).name, "tag": tag, "size": Path(p).stat().st_size, **_describe(p)})
            self.logged_model_time[p] = t


def observe(trainer: L.Trainer, callback: ModelCheckpoint, logger: UploadRecorder) -> dict[str, Any]:
    dirpath = Path(callback.dirpath)
    names = sorted(os.listdir(dirpath))
    return {
        "listing": names,
        "paths": {name: _describe(str(dirpath / name)) for name in names},
        "best_model_path": Path(callback.best_model_path).name,
        "best_k_models": {Path(k).name: float(v) for k, v in callback.best_k_models.items()},
        "last_model_path": Path(callback.last_model_path).name if callback.last_model_path else "",
        "uploads": logger.uploads,
        "logger_calls": logger.calls,
    }


def _slow_disk(seconds: float) -> None:
    import time

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_ft.checkpoint.single_file import FileStorage
    from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

    def slowed(write: Any) -> Any:
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return write(*args, **kwargs)

        return slow

    for cls, name in ((TorchCheckpointIO, "save_checkpoint"), (FileStorage, "write"), (SnapshotStorage, "write")):
        setattr(cls, name, slowed(getattr(cls, name)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "elastic"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--save-last", default="true")
    parser.add_argument("--filename", default="model")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--slow-write-s", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_write_s:
        _slow_disk(args.slow_write_s)
    save_last: Any = {"true": True, "false": False, "link": "link"}[args.save_last]
    root = Path(args.root)
    torch.manual_seed(0)
    if args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy()
    else:
        from lightning_ft import ElasticFT3D

        strategy = ElasticFT3D()
    callback = ModelCheckpoint(
        dirpath=root / "ckpt",
        filename=args.filename,
        monitor="score",
        mode="max",
        save_top_k=-1,
        save_last=save_last,
        every_n_train_steps=args.every,
    )
    logger = UploadRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        default_root_dir=root,
        logger=logger,
        callbacks=[callback],
        max_steps=args.max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(Model())
    if trainer.is_global_zero:
        (root / "observed.json").write_text(json.dumps(observe(trainer, callback, logger), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
