"""One replica group (a torchrun job of 2 processes) of a sharded model under ``ElasticFT3D(replica_groups=...)``, for
tests/replica/test_replica_sharded_e2e.py.

``--model fsdp2``: a float64 MLP whose ``configure_model`` calls ``fully_shard`` on the ``"data_parallel"`` mesh of the
group (2 data-parallel ranks, each holding half of every parameter). ``--model tp``: Lightning's
``examples/pytorch/tensor_parallel`` Llama model and its ``parallelize`` function (tests/e2e/tensor_parallel_example/) at tiny
dimensions, ``tensor_parallel_size=2`` (one data-parallel rank; the two ranks hold different shards and read the same
batches), in float64 with ``loss_parallel`` as in the example.

After every committed step, every rank appends one JSON line to ``<out>/steps-rank<r>.jsonl``: the global step, its
pid, a fingerprint of its own shards of each part of the state a heal must copy (weights, optimizer, LR scheduler,
torch/numpy/Python RNG, the loop counters), the accumulation in force and the sample ids of every micro-batch of the
step. While ``<out>/../hold`` exists each training step sleeps the seconds it holds (empty: ``--step-sleep``), so that
the test can kill and replace a group mid-run; while ``<out>/hang`` exists the training step does not return (a hung
group: every rank stops, torchft's heartbeats go on); ``--start-gate`` holds the first step until the test has seen
every group start. At the end each rank saves its local shards to ``<out>/final<r>.pt``.

The decisions of tests/replica/test_replica_sharded_scenario_e2e.py: ``--learnable`` gives the model something to learn
(FSDP2: targets ``sin(x[:, :4])`` plus noise; tensor parallel: each next token is the previous one plus 1 with
probability 1/2) and a slower ``StepLR`` (every 50 steps by 0.95); ``--samples`` the epoch's length; ``--val-samples N``
a validation set every group shares, validated at each epoch's end (global rank 0 appends ``{step, val_loss}`` to
``<out>/val.jsonl``); ``--plateau`` a ``ReduceLROnPlateau(monitor="val_loss")`` beside the ``StepLR`` (its state in
each record as ``plateau``); ``--early-stop D`` an ``EarlyStopping(monitor="val_loss", min_delta=D, patience=1)``;
``--max-epochs`` bounds the fit by epochs instead of ``--max-steps``.

``--accelerator cuda --process-group nccl`` runs it on GPUs, the groups joined over NCCL
(tests/replica/test_replica_sharded_gpu.py). ``--strategy elastic`` runs one ``ElasticFT3D`` job without replica groups (the same model, sharding and sample
stream): the reference. ``--ckpt-dir`` adds ``ModelCheckpoint(every_n_train_steps=--every-n)``; ``--pause-at N`` stops
stepping at committed step N once that step's checkpoint is committed (a whole job killed at a known step).
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
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "e2e" / "tensor_parallel_example")
)  # the example imports `model`

from lightning_ft import ElasticFT3D, ElasticPolicy, ReplicaGroups  # noqa: E402
from tests.replica._state_digest import digest  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--model", choices=("fsdp2", "tp"), required=True)
parser.add_argument("--max-steps", type=int, default=30)
parser.add_argument("--step-sleep", type=float, default=0.3)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--strategy", choices=("replica", "elastic"), default="replica")
parser.add_argument("--timeout-s", type=float, default=3.0)
parser.add_argument("--min-replicas", type=int, default=1)
parser.add_argument("--ckpt-dir", default=None)
parser.add_argument("--every-n", type=int, default=5)
parser.add_argument("--pause-at", type=int, default=0)
parser.add_argument("--accelerator", default="cpu")
parser.add_argument("--process-group", default="gloo", help="ReplicaGroups(process_group=...)")
parser.add_argument("--start-gate", default=None, help="at on_train_start: write <out>/ready<r>, wait for this file")
parser.add_argument("--samples", type=int, default=4096, help="training samples (an epoch)")
parser.add_argument("--max-epochs", type=int, default=0, help="bound the fit by epochs (0: by --max-steps)")
parser.add_argument("--learnable", action="store_true", help="targets a model can learn, a slower StepLR")
parser.add_argument("--val-samples", type=int, default=0, help="a validation set every group shares (0: none)")
parser.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau(monitor='val_loss'), stepped each epoch")
parser.add_argument("--early-stop", type=float, default=None, help="EarlyStopping(monitor='val_loss', min_delta=...)")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
hold = out.parent / "hold"
SAMPLES = args.samples
BATCH = 4


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Tokens(Dataset):
    """The example's ``RandomTokenDataset`` (seeded, the same on every rank), with each sample's id; ``--learnable``:
    each next token is the previous one plus 1 (modulo the vocabulary) with probability 1/2."""

    def __init__(self, vocab_size: int, seq_length: int, samples: int = SAMPLES, seed: int = 42) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab_size, size=(samples, seq_length + 1), generator=g)
        if args.learnable:
            follow = torch.rand(samples, seq_length + 1, generator=g) < 0.5
            for i in range(1, seq_length + 1):
                successor = (self.tokens[:, i - 1] + 1) % vocab_size
                self.tokens[:, i] = torch.where(follow[:, i], successor, self.tokens[:, i])

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, item: int):
        return self.tokens[item], item


class Sleepy(L.LightningModule):
    def hold(self) -> None:
        try:
            time.sleep(float(hold.read_text() or args.step_sleep))
        except FileNotFoundError:
            pass
        while (out / "hang").exists():  # a hung group: the training thread stops, torchft's heartbeat thread goes on
            time.sleep(0.1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, foreach=True)
        step_size, gamma = (50, 0.95) if args.learnable else (7, 0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
        schedulers = [{"scheduler": scheduler, "interval": "step"}]
        if args.plateau:  # Lightning steps it at each epoch's end, after the validation, with its val_loss
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.02)
            schedulers.append({"scheduler": plateau, "monitor": "val_loss"})
        return [optimizer], schedulers

    def val_dataloader(self):
        return DataLoader(self.dataset(args.val_samples, seed=99), batch_size=BATCH)


class FSDP2Model(Sleepy):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        self.hold()
        x, y, _ = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    @staticmethod
    def dataset(samples: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(samples, 16, generator=g), torch.randn(samples, 4, generator=g)
        if args.learnable:
            y = torch.sin(x[:, :4]) + 0.1 * y
        return TensorDataset(x.double(), y.double(), torch.arange(samples))

    def train_dataloader(self):
        return DataLoader(self.dataset(SAMPLES, seed=1234), batch_size=BATCH, shuffle=True)


class Llama3(Sleepy):
    """Lightning's example ``Llama3`` at tiny dimensions; the batches carry sample ids."""

    def __init__(self) -> None:
        super().__init__()
        from model import ModelArgs, Transformer

        self.model_args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)
        self.model = Transformer(self.model_args)

    def configure_model(self) -> None:
        from parallelism import parallelize

        parallelize(self.model, device_mesh=self.device_mesh)

    def training_step(self, batch, batch_idx):
        self.hold()
        return self.loss(batch)

    def loss(self, batch):
        from torch.distributed.tensor.parallel import loss_parallel

        tokens, _ = batch
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", local(self.loss(batch)), sync_dist=True)  # a replicated DTensor under loss_parallel

    def backward(self, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def train_dataloader(self):
        return DataLoader(Tokens(self.model_args.vocab_size, seq_length=8), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Tokens(self.model_args.vocab_size, 8, samples=args.val_samples, seed=99), batch_size=BATCH)


class Record(Callback):
    def __init__(self) -> None:
        self.micro: list[int] = []
        self.closed: list[int] = []
        self.voted = False
        self.before = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.micro += batch[-1].tolist()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.closed, self.micro = self.micro, []
        self.voted = True
        self.before = trainer.global_step  # after any heal of this step (at its quorum), before the vote

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Only where the step was committed: it counted one more step (a discarded one, the first step of a healed
        # group's included, leaves the count where the vote found it).
        voted, self.voted = self.voted, False
        if not voted or trainer.global_step != self.before + 1:
            return
        optimizer = trainer.optimizers[0]
        opt_state = next(iter(optimizer.state.values()))
        record = {
            "step": trainer.global_step,
            "pid": os.getpid(),
            "time": time.time(),
            "weights": digest(pl_module.state_dict()),
            "optimizer": digest(optimizer.state_dict()),
            "scheduler": digest(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "plateau": digest([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs[1:]]),
            "lr": optimizer.param_groups[0]["lr"],
            "adam_steps": int(opt_state["step"]),
            "rng": digest([torch.get_rng_state(), np.random.get_state()[1], random.getstate()]),
            "loop": [trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.current_epoch],
            "accumulate": trainer.accumulate_grad_batches,
            "step_samples": self.closed,
        }
        with open(out / f"steps-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return
        record = {"step": trainer.global_step, "val_loss": float(trainer.callback_metrics["val_loss"]).hex()}
        with open(out / "val.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


class StartGate(Callback):
    """Every group's manager heartbeats before any asks for its first quorum: the first quorum holds every group that
    the test started (the lighthouse waits its join timeout for the heartbeating ones)."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate

    def on_train_start(self, trainer, pl_module) -> None:
        (out / f"ready{trainer.global_rank}").touch()
        while not self.gate.exists():
            time.sleep(0.1)


class PauseAt(Callback):
    """At committed step ``step``: wait for the save in flight, write ``<out>/paused`` and stop stepping (the heartbeats
    go on) until the test kills the group."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        trainer.strategy.checkpoint_wait()
        (out / f"paused{trainer.global_rank}").write_text(str(self.step))
        while True:
            time.sleep(1)


L.seed_everything(0)
tp = 2 if args.model == "tp" else 1
policy = ElasticPolicy(batch="keep_global")
if args.strategy == "elastic":
    strategy = ElasticFT3D(tensor_parallel_size=tp, elastic=policy)
else:
    groups = ReplicaGroups(
        address="127.0.0.1",
        min_replicas=args.min_replicas,
        timeout=timedelta(seconds=args.timeout_s),
        process_group=args.process_group,
    )
    strategy = ElasticFT3D(tensor_parallel_size=tp, elastic=policy, replica_groups=groups)
callbacks: list[Callback] = [Record()]
if args.start_gate:
    callbacks.append(StartGate(Path(args.start_gate)))
if args.pause_at:
    callbacks.append(PauseAt(args.pause_at))
if args.ckpt_dir:
    callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every_n, save_top_k=-1))
if args.early_stop is not None:
    callbacks.append(EarlyStopping(monitor="val_loss", min_delta=args.early_stop, patience=1))
trainer = L.Trainer(
    accelerator=args.accelerator,
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy,
    max_steps=-1 if args.max_epochs else args.max_steps,
    max_epochs=args.max_epochs or None,
    accumulate_grad_batches=args.accumulate,
    precision="64-true",
    limit_val_batches=None if args.val_samples else 0,
    num_sanity_val_steps=0,
    enable_checkpointing=bool(args.ckpt_dir),
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=callbacks,
)
trainer.fit(FSDP2Model() if args.model == "fsdp2" else Llama3())
shards = {k: local(v).detach().cpu().clone() for k, v in trainer.lightning_module.state_dict().items()}
torch.save(shards, out / f"final{trainer.global_rank}.pt")
if trainer.global_rank == 0:
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    (out / "done.json").write_text(json.dumps({"global_step": trainer.global_step, "pid": os.getpid(), "lr": lr}))
