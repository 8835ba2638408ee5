"""One replica group (a torchrun job) as the docs set it up, with every default: ``ReplicaGroups()`` (its lighthouse,
id and group count from torchft's variables), ``GoodputMonitor()``, Lightning's ``TensorBoardLogger``, and a
``ModelCheckpoint`` in a folder all groups share. For tests/replica/test_replica_defaults_e2e.py.

A replacement for a lost group runs this script again with the lost group's ``REPLICA_GROUP_ID`` and ``--out`` (its
``default_root_dir``), as a scheduler relaunching the group would.

Files the test creates: while ``<out>/../hold`` exists every training step sleeps ``--step-sleep`` seconds (the
groups overlap); once ``<out>/kill-mid-save`` exists, a :class:`~lightning_ft.fault.FaultInjector` SIGKILLs the
group's worker in the middle of the write of its next checkpoint (``kill_at(during="write")``: the writer group lost
mid-save); once ``<out>/../stop`` holds a step, every group stops there. After every committed step, rank 0 appends
``{step, time, pid}`` to ``<out>/steps.jsonl``; at the end, ``<out>/done.json`` (global step, pid).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, ElasticPolicy, GoodputMonitor, ReplicaGroups  # noqa: E402
from lightning_ft.fault import FaultInjector  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--every-n", type=int, default=10)
parser.add_argument("--samples", type=int, default=400_000)
parser.add_argument("--step-sleep", type=float, default=0.1)
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
hold = out.parent / "hold"


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        if hold.exists():
            time.sleep(args.step_sleep)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(args.samples, 16, generator=g), torch.randn(args.samples, 4, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True)


class Record(Callback):
    """A line per committed step; the kill armed once its file exists; the stop at the step the stop file names."""

    def __init__(self, injector: FaultInjector) -> None:
        self.last = -1
        self.injector = injector
        self.armed = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and step != self.last:
            self.last = step
            with open(out / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
        if not self.armed and (out / "kill-mid-save").exists():
            self.armed = True
            self.injector.kill_at(rank=0, step=(step // args.every_n + 1) * args.every_n, during="write")
        stop = out.parent / "stop"
        if stop.exists() and stop.read_text().strip() and step >= int(stop.read_text()):
            trainer.should_stop = True


torch.set_num_threads(1)
L.seed_everything(0)
# A write fault from the start routes the checkpoint writes through the injector (the strategy asks at set-up); this
# one never fires. The test arms the real one (Record).
injector = FaultInjector().kill_at(rank=0, step=10**9, during="write")
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    # Three groups of accumulation 1 cannot keep the global batch at two: the per-group batch is kept.
    strategy=ElasticFT3D(replica_groups=ReplicaGroups(), elastic=ElasticPolicy(batch="keep_local")),
    max_steps=10**6,
    limit_val_batches=0,
    logger=TensorBoardLogger(str(out), name="tb"),
    log_every_n_steps=5,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=[
        Record(injector),
        GoodputMonitor(),
        ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every_n, save_top_k=-1),
        injector,
    ],
)
trainer.fit(Model())
if trainer.global_rank == 0:
    (out / "done.json").write_text(json.dumps({"global_step": trainer.global_step, "pid": os.getpid()}))
