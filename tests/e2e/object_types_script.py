"""Save and resume a run whose callback counts with a ``Counter`` and whose module saves a namedtuple, an
``OrderedDict`` and a ``frozenset``, under DDPStrategy or ElasticFT3D; launched under real torchrun. Each rank writes
the types it got back at the resume to ``--out``/types_rank<N>.json."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter, OrderedDict, namedtuple
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

Point = namedtuple("Point", "x y")


class Counting(Callback):
    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.loaded: str | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts["batches"] += 1

    def state_dict(self):
        return {"counts": self.counts}

    def load_state_dict(self, state_dict) -> None:
        self.counts = state_dict["counts"]
        self.loaded = type(self.counts).__name__
        self.counts["resumed"] += 1  # a plain dict raises KeyError


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.restored: dict = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["point"] = Point(1, 2)
        checkpoint["ordered"] = OrderedDict(b=1, a=2)
        checkpoint["tags"] = frozenset({"x"})

    def on_load_checkpoint(self, checkpoint) -> None:
        self.restored = {k: type(checkpoint[k]).__name__ for k in ("point", "ordered", "tags")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "elasticft"], required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-format", default="auto", help="ElasticFT3D(checkpoint_format=...)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.serialization.add_safe_globals([Point, frozenset])  # as the docs say for classes torch does not allow
    L.seed_everything(3)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    root = Path(args.root)

    def trainer(max_steps: int, callbacks) -> L.Trainer:
        if args.strategy == "ddp":
            strategy = DDPStrategy(process_group_backend="gloo")
        else:
            from lightning_ft import ElasticFT3D

            strategy = ElasticFT3D(checkpoint_format=args.checkpoint_format)
        return L.Trainer(
            accelerator="cpu",
            devices=int(os.environ["LOCAL_WORLD_SIZE"]),
            strategy=strategy,
            default_root_dir=root,
            max_steps=max_steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )

    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    trainer(2, [ckpt, Counting()]).fit(Module(), DataLoader(data, batch_size=4))
    counting, module = Counting(), Module()
    resumed = trainer(3, [counting])
    resumed.fit(module, DataLoader(data, batch_size=4), ckpt_path=str(root / "checkpoints" / "epoch=0-step=2.ckpt"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = resumed.global_rank
    (out / f"types_rank{rank}.json").write_text(json.dumps({"counter": counting.loaded, **module.restored}))


if __name__ == "__main__":
    main()
