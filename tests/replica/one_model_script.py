"""One replica group (a torchrun job) of a float64 LightningModule with a validation set, for
tests/replica/test_one_model_e2e.py; ``--strategy ddp`` runs the same training under Lightning's ``DDPStrategy``
(the oracle: one process with the full accumulation, no replica groups).

The model is deterministic (float64, no dropout): runs that train the same samples per step end equal up to the
rounding of the summation order. Every ``--val-every`` (a fraction of the epoch, so that the groups and the reference
validate after the same committed steps) the loop validates on a set that every group shares; ``val_loss`` is
logged with ``sync_dist=True``.

Records (rank 0): ``<out>/steps.jsonl`` one line per committed step (step, weights digest, learning rate, scheduler
state); ``<out>/val.jsonl`` one line per validation (step, ``val_loss`` as ``float.hex``, learning rate);
``<out>/final0.pt`` and ``<out>/done.json`` at the end. Injected faults (by this group's own callback, out of band,
after the step's vote): ``--edit-weight-at N`` adds 1e-3 to one weight after step N, ``--edit-lr-at N`` halves the
learning rate after step N, ``--edit-lr-every-from N`` does so after every step from N, ``--stop-at N`` sets
``trainer.should_stop`` after step N on this group only. While ``<out>/../hold`` exists every training step
sleeps ``--step-sleep`` seconds. ``--no-checks`` turns the one-model comparisons off (the baseline of a cost
measurement; the library has no such switch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D, ElasticPolicy, ReplicaGroups  # noqa: E402
from tests.replica._state_digest import digest  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=960)
parser.add_argument("--val-samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--precision", default="64-true")
parser.add_argument("--val-every", type=float, default=0.25)
parser.add_argument("--max-steps", type=int, default=-1)
parser.add_argument("--min-replicas", type=int, default=1)
parser.add_argument("--timeout-s", type=float, default=3.0)
parser.add_argument("--strategy", choices=("replica", "ddp"), default="replica")
parser.add_argument("--policy", choices=("keep_global", "keep_local"), default="keep_global")
parser.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau(monitor='val_loss') at each validation")
parser.add_argument("--early-stop", type=float, default=None, help="EarlyStopping(min_delta=...) on val_loss")
parser.add_argument("--edit-weight-at", type=int, default=None)
parser.add_argument("--edit-lr-at", type=int, default=None)
parser.add_argument("--edit-lr-every-from", type=int, default=None)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--step-sleep", type=float, default=0.2, help="seconds each training step sleeps while held")
parser.add_argument("--no-checks", action="store_true", help="a measurement's baseline: no one-model comparison")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
hold = out.parent / "hold"


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights in every group and in the reference
            torch.manual_seed(7)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 4)
            ).double()

    def training_step(self, batch, batch_idx):
        if hold.exists():
            time.sleep(args.step_sleep)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=args.lr)
        if not args.plateau:
            return optimizer
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.05)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

    def _data(self, n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 16, generator=g, dtype=torch.float64)
        return TensorDataset(x, torch.sin(x[:, :4]) + 0.1 * torch.randn(n, 4, generator=g, dtype=torch.float64))

    def train_dataloader(self):
        return DataLoader(self._data(args.samples, 1234), batch_size=args.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self._data(args.val_samples, 99), batch_size=16)


class Faults(Callback):
    """This group's own out-of-band changes, after a step's vote (``on_train_batch_end`` of its last micro-batch)."""

    def __init__(self) -> None:
        self.done: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        optimizer = trainer.optimizers[0]
        if step == args.edit_weight_at and "weight" not in self.done:
            self.done.add("weight")
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] += 1e-3
        if (step == args.edit_lr_at and "lr" not in self.done) or (
            args.edit_lr_every_from is not None and step >= args.edit_lr_every_from
        ):
            self.done.add("lr")
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        if step == args.stop_at:
            trainer.should_stop = True


class Record(Callback):
    def __init__(self) -> None:
        self.last = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0 or trainer.global_step == self.last:
            return
        self.last = trainer.global_step
        optimizer = trainer.optimizers[0]
        record = {
            "step": trainer.global_step,
            "time": time.time(),
            "weights": digest(pl_module.state_dict()),
            "lr": optimizer.param_groups[0]["lr"],
            "schedulers": digest([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]),
        }
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return
        record = {
            "step": trainer.global_step,
            "val_loss": float(trainer.callback_metrics["val_loss"]).hex(),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        with open(out / "val.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


if args.no_checks:  # the cost's baseline: the groups exchange nothing beyond torchft's own
    from lightning_ft.replica.one_model import OneModel

    OneModel._compare = lambda self, point, **kwargs: None
    OneModel.after_quorum = lambda self, **kwargs: True

L.seed_everything(0)  # the job's seed: the sampler's order (PL_GLOBAL_SEED) is the same in every group
torch.manual_seed(1000 + int(os.environ.get("REPLICA_GROUP_ID", "0")))  # each group's own RNG (copied by a heal)
callbacks: list[Callback] = [Record(), Faults()]  # the record of a step before an edit after it
if args.early_stop is not None:
    callbacks.append(EarlyStopping(monitor="val_loss", min_delta=args.early_stop, patience=0))
if args.strategy == "ddp":
    strategy = DDPStrategy()
else:
    groups = ReplicaGroups(
        address="127.0.0.1", min_replicas=args.min_replicas, timeout=timedelta(seconds=args.timeout_s)
    )
    strategy = ElasticFT3D(elastic=ElasticPolicy(batch=args.policy, lr_scaling="none"), replica_groups=groups)
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy,
    max_epochs=1,
    max_steps=args.max_steps,
    precision=args.precision,
    accumulate_grad_batches=args.accumulate,
    val_check_interval=args.val_every,
    num_sanity_val_steps=0,
    enable_checkpointing=False,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=callbacks,
)
trainer.fit(Model())
torch.save(trainer.lightning_module.state_dict(), out / f"final{trainer.global_rank}.pt")
if trainer.global_rank == 0:
    done = {"global_step": trainer.global_step, "pid": os.getpid(), "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    (out / "done.json").write_text(json.dumps(done))
