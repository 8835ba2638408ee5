"""One replica group (a torchrun job) of a plain float64 LightningModule, for the failure scenario of
tests/replica/test_replica_scenario_e2e.py; ``--strategy reference`` runs the same training as one process without
replica groups (the run without failures the scenario's final weights are compared with).

The model is deterministic (no dropout, no noise: the final weights depend on the data stream only), in float64 so
that a different summation order costs ~1e-16 relative per step. Each group seeds its global RNG differently after
``seed_everything`` (the sampler's seed stays the job's), and every micro-batch draws from it, so the RNG a heal
copies is not equal by chance.

After every committed step, rank 0 appends one JSON line to ``<out>/steps.jsonl``: the global step, its pid, the
micro-batches of that step (the dataset indices, in order) and a fingerprint of each part of the state a heal must copy
(weights, optimizer, LR scheduler, RNG, loop counters). Fault flags, files the test creates:

- ``<out>/../hold``: while it exists each micro-batch sleeps ``--step-sleep`` seconds (the scenario's pace);
- ``<out>/slow``: while it exists each micro-batch sleeps ``--slow-sleep`` more (a straggler group);
- ``<out>/hang``: while it exists the training step does not return (a hung rank; torchft's heartbeats go on).

At the end: ``<out>/final<rank>.pt`` (the weights) and ``<out>/done.json`` (global step, pid).

``--val-samples N`` adds a validation set every group shares (validated at each epoch's end; rank 0 appends
``{step, val_loss}`` to ``<out>/val.jsonl``), ``--plateau`` a ``ReduceLROnPlateau(monitor="val_loss")`` beside the
``StepLR`` (its state in each record as ``plateau``), ``--early-stop D`` an ``EarlyStopping(monitor="val_loss",
min_delta=D, patience=1)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, ElasticPolicy, ReplicaGroups, StragglerMonitor  # noqa: E402
from tests.replica._state_digest import digest  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=24000)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--max-epochs", type=int, default=1)
parser.add_argument("--step-sleep", type=float, default=0.1)
parser.add_argument("--slow-sleep", type=float, default=0.4)
parser.add_argument("--min-replicas", type=int, default=2)
parser.add_argument("--timeout-s", type=float, default=3.0)
parser.add_argument("--lighthouse-wait-s", type=float, default=300.0, help="ReplicaGroups(lighthouse_wait=...)")
parser.add_argument("--policy", choices=("keep_local", "keep_global"), default="keep_local")
parser.add_argument("--strategy", choices=("replica", "reference"), default="replica")
parser.add_argument("--drop-sample", type=int, default=None, help="an ablation: this dataset index adds no gradient")
parser.add_argument("--val-samples", type=int, default=0, help="a validation set every group shares (0: none)")
parser.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau(monitor='val_loss'), stepped each epoch")
parser.add_argument("--early-stop", type=float, default=None, help="EarlyStopping(monitor='val_loss', min_delta=...)")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
hold = out.parent / "hold"


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights in every group and in the reference
            torch.manual_seed(7)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
        self.pending: list[list[int]] = []  # this step's micro-batches so far
        self.step_batches: list[list[int]] = []  # the micro-batches of the last step that reached the optimizer
        self.voted_at: int | None = None

    def training_step(self, batch, batch_idx):
        if hold.exists():
            time.sleep(args.step_sleep)
        if (out / "slow").exists():
            time.sleep(args.slow_sleep)
        while (out / "hang").exists():  # a hung rank: the training thread stops, torchft's heartbeat thread goes on
            time.sleep(0.1)
        torch.rand(1)  # the global RNG moves with every micro-batch: a heal must copy it
        x, y, index = batch
        self.pending.append(index.tolist())
        if args.drop_sample is not None:  # the ablation: one sample of the epoch leaves no trace
            keep = (index != args.drop_sample).to(x.dtype)[:, None]
            return (((self.net(x) - y) ** 2) * keep).mean()
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:  # every step's last micro-batch, committed or discarded
        self.step_batches, self.pending = self.pending, []
        self.voted_at = self.trainer.global_step  # committed steps before this one: +1 after it iff it commits

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.95)
        schedulers = [{"scheduler": scheduler, "interval": "step"}]
        if args.plateau:  # Lightning steps it at each epoch's end, after the validation, with its val_loss
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.02)
            schedulers.append({"scheduler": plateau, "monitor": "val_loss"})
        return [optimizer], schedulers

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(99)
        x = torch.randn(args.val_samples, 16, generator=g, dtype=torch.float64)
        y = torch.sin(x[:, :4]) + 0.1 * torch.randn(args.val_samples, 4, generator=g, dtype=torch.float64)
        return DataLoader(TensorDataset(x, y, torch.arange(args.val_samples)), batch_size=16)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        n = args.samples
        x = torch.randn(n, 16, generator=g, dtype=torch.float64)
        y = torch.sin(x[:, :4]) + 0.1 * torch.randn(n, 4, generator=g, dtype=torch.float64)
        return DataLoader(TensorDataset(x, y, torch.arange(n)), batch_size=args.batch_size, shuffle=True)


class Record(Callback):
    """One record per committed step, at its last micro-batch: not at a step that was discarded, nor where a heal
    (a joining group, or a live one that missed a quorum) moved ``global_step`` at the start of a step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        voted_at, pl_module.voted_at = pl_module.voted_at, None
        if trainer.global_rank != 0 or voted_at is None or trainer.global_step != voted_at + 1:
            return
        optimizer = trainer.optimizers[0]
        record = {
            "step": trainer.global_step,
            "pid": os.getpid(),
            "time": time.time(),
            "epoch": trainer.current_epoch,
            "batches": pl_module.step_batches,
            "weights": digest(pl_module.state_dict()),
            "optimizer": digest(optimizer.state_dict()),
            "scheduler": digest(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "lr": optimizer.param_groups[0]["lr"],
            "adam_steps": int(next(iter(optimizer.state.values()))["step"]),
            "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "rng": digest([torch.get_rng_state(), np.random.get_state()[1], random.getstate()]),
            "plateau": digest([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs[1:]]),
            "loop": [trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.current_epoch],
        }
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return
        record = {"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"]).hex()}
        with open(out / "val.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


L.seed_everything(0)  # the job's seed: the sampler's order (PL_GLOBAL_SEED) is the same in every group
group_seed = 1000 + int(os.environ.get("REPLICA_GROUP_ID", "0"))
torch.manual_seed(group_seed)
np.random.seed(group_seed)
random.seed(group_seed)
policy = ElasticPolicy(batch=args.policy, lr_scaling="none")
callbacks: list[Callback] = [Record()]
if args.early_stop is not None:
    callbacks.append(EarlyStopping(monitor="val_loss", min_delta=args.early_stop, patience=1))
if args.strategy == "reference":  # one process, no replica groups: the run without failures
    strategy = ElasticFT3D(elastic=policy)
else:
    groups = ReplicaGroups(
        address="127.0.0.1",
        min_replicas=args.min_replicas,
        timeout=timedelta(seconds=args.timeout_s),
        lighthouse_wait=timedelta(seconds=args.lighthouse_wait_s),
    )
    strategy = ElasticFT3D(elastic=policy, replica_groups=groups)
    # min_excess_ms: a group must be 50 ms a step slower than the others to be named; the straggler is ~400 ms slower,
    # a healthy group's jitter on this loaded machine once the hold is lifted a few ms.
    callbacks.append(StragglerMonitor(interval=4, warmup_steps=2, patience=2, min_excess_ms=50, action="evict"))
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy,
    max_epochs=args.max_epochs,
    accumulate_grad_batches=args.accumulate,
    limit_val_batches=None if args.val_samples else 0,
    num_sanity_val_steps=0,
    enable_checkpointing=False,
    logger=CSVLogger(str(out), name="csv", version=0),
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=callbacks,
)
trainer.fit(Model())
torch.save(trainer.lightning_module.state_dict(), out / f"final{trainer.global_rank}.pt")
if trainer.global_rank == 0:
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    (out / "done.json").write_text(json.dumps({"global_step": trainer.global_step, "pid": os.getpid(), "lr": lr}))
