"""One replica group (a torchrun job) of a plain LightningModule under ``ElasticFT3D(replica_groups=...)``, for
tests/replica/test_replica_groups_e2e.py.

After every committed step, rank 0 appends one JSON line to ``<out>/steps.jsonl``: the global step, its own pid, and
a fingerprint of each part of the state a heal must copy (weights, optimizer, LR scheduler, torch/numpy/Python RNG,
a stateful callback, the loop counters). While ``<out>/../hold`` exists each training step sleeps ``--step-sleep``
seconds, so that the test can kill and replace a group mid-run; without it the run goes at full speed. While
``<out>/hang`` exists the training step does not return (a hung rank). ``REPLICA_TEST_SLOW_STEP_S`` makes every
training step of this group sleep that long (a straggler group); ``--evict-stragglers`` adds
``StragglerMonitor(action="evict")`` (tests/replica/test_replica_eviction_e2e.py).

``--policy`` chooses ``ElasticFT3D(elastic=...)`` (default ``keep_local_none``: the per-group batch and the LR kept;
``default``: the strategy's own default, ``ElasticPolicy()``);
``--accumulate`` the Trainer's ``accumulate_grad_batches``; ``--deterministic`` a float64 model (``precision="64-true"``)
without dropout or noise, trained with SGD, so that runs that see the same samples per step end equal up to the
rounding of the summation order (tests/replica/test_replica_policy_e2e.py); ``--strategy elastic`` one
``ElasticFT3D`` job without replica groups (a reference on the same sample stream). Each record also holds
``accumulate`` (the accumulation in force) and ``step_samples`` (the sample ids of every micro-batch of the step).
``--evict-on health_check`` adds the periodic health checks every ``--health-every`` steps with ``FaultPolicy(health_check_action="evict")``,
``--evict-on thermal`` adds ``ThermalMonitor(action="evict")``; both read a ``FakeNVML`` (a CPU has no NVML: the
seam the non-replica eviction tests use, tests/fault/fault_script.py and tests/fault/test_eviction.py), and on the
ranks named by ``REPLICA_TEST_SICK_RANKS`` (a comma list of group ranks) its device turns sick from the start of
step ``--sick-from`` on: 2 uncorrected ECC errors (health checks) or a hardware thermal slowdown (thermal)
(tests/replica/test_replica_health_eviction_e2e.py).
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
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import (  # noqa: E402
    ElasticFT3D,
    ElasticPolicy,
    FaultPolicy,
    MemoryTier,
    ReplicaGroups,
    StragglerMonitor,
    ThermalMonitor,
)
from lightning_ft.nvml import FakeNVML  # noqa: E402
from tests.replica._state_digest import digest  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--max-steps", type=int, default=60)
parser.add_argument("--step-sleep", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--min-replicas", type=int, default=1)
parser.add_argument("--strategy", choices=("replica", "ddp", "elastic"), default="replica")
parser.add_argument(
    "--policy",
    choices=("default", "keep_global", "keep_local", "keep_local_none", "none"),
    default="keep_local_none",  # most cases run 3 groups of accumulation 1, which keep_global refuses at set-up
)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--deterministic", action="store_true")
parser.add_argument("--timeout-s", type=float, default=3.0)
parser.add_argument("--lighthouse-wait-s", type=float, default=300.0, help="ReplicaGroups(lighthouse_wait=...)")
parser.add_argument("--evict-stragglers", action="store_true")
parser.add_argument("--ckpt-dir", default=None, help="a ModelCheckpoint(dirpath=...) every --every-n steps (shared)")
parser.add_argument("--every-n", type=int, default=10)
parser.add_argument(
    "--memory-every", type=int, default=0, help="ElasticFT3D(memory_tier=MemoryTier(every_n_train_steps=N))"
)
parser.add_argument(
    "--pause-at", type=int, default=0, help="at this committed step: wait for both tiers' saves, then stop stepping"
)
parser.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint(save_top_k=...)")
parser.add_argument("--monitor-step", action="store_true", help="ModelCheckpoint(monitor='step', mode='max')")
parser.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
parser.add_argument("--evict-on", choices=("health_check", "thermal"), default=None)
parser.add_argument("--health-every", type=int, default=5, help="FaultPolicy.health_check_every_n_steps")
parser.add_argument("--sick-from", type=int, default=10, help="the sick ranks' device is sick from this step on")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
hold = out.parent / "hold"
slow_step_s = float(os.environ.get("REPLICA_TEST_SLOW_STEP_S", "0"))
save_delay_s = float(os.environ.get("REPLICA_TEST_SAVE_DELAY_S", "0"))  # before ModelCheckpoint's save of a step


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        if args.deterministic:  # no dropout, no noise: the result depends only on the samples of each step
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        else:
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        if hold.exists():
            time.sleep(args.step_sleep)
        time.sleep(slow_step_s)
        while (out / "hang").exists():  # a hung rank: the training thread stops, torchft's heartbeat thread goes on
            time.sleep(0.1)
        x, y, _ = batch
        if args.deterministic:
            return torch.nn.functional.mse_loss(self.net(x), y)
        noise = torch.randn_like(x) * 0.01  # the RNG is part of the state
        return torch.nn.functional.mse_loss(self.net(x + noise), y)

    def configure_optimizers(self):
        if args.deterministic:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(
            torch.randn(20000, 16, generator=g), torch.randn(20000, 4, generator=g), torch.arange(20000)
        )
        return DataLoader(data, batch_size=8, shuffle=True)


class Batches(Callback):
    """A stateful callback: the batches it has seen (discarded steps included) travel with a heal."""

    def __init__(self) -> None:
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state_dict) -> None:
        self.seen = state_dict["seen"]


class SaveDelay(Callback):
    """``REPLICA_TEST_SAVE_DELAY_S``: wait that long before ``ModelCheckpoint`` (always the last callback) saves at a
    step, so that this group names its save after the writer's file of the step is there."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if save_delay_s and trainer.global_step % args.every_n == 0:
            time.sleep(save_delay_s)


class SickDevice(Callback):
    """From the start of step ``step`` on, on the ranks named by ``REPLICA_TEST_SICK_RANKS``, the fake NVML device
    reads 2 uncorrected ECC errors (``"health_check"``) or a hardware thermal slowdown (``"thermal"``)."""

    def __init__(self, nvml: FakeNVML, kind: str, step: int) -> None:
        self.nvml, self.kind, self.step = nvml, kind, step
        self.ranks = {int(r) for r in os.environ.get("REPLICA_TEST_SICK_RANKS", "").split(",") if r.strip()}
        self.sick = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sick or trainer.global_rank not in self.ranks or trainer.global_step < self.step:
            return
        self.sick = True
        print(f"[fault] rank {trainer.global_rank}: NVML reports {self.kind} at step {trainer.global_step}", flush=True)
        if self.kind == "health_check":
            self.nvml.set(0, ecc_uncorrected=2.0)
        else:
            self.nvml.throttle(0, "HwThermalSlowdown", temperature_c=95.0, sm_clock_mhz=900.0)


class Record(Callback):
    def __init__(self, batches: Batches) -> None:
        self.batches = batches
        self.last = -1
        self.micro: list[int] = []  # sample ids of the micro-batches of the running step
        self.closed: list[int] = []  # ... of the step being voted on
        self.voted = False  # the running step reached its vote (the closure ran): its last micro-batch ends now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.micro += batch[2].tolist()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        assert isinstance(optimizer, (torch.optim.Adam, torch.optim.SGD)), type(optimizer)  # the user's own optimizer
        self.closed, self.micro = self.micro, []  # committed or discarded: the next step starts afresh
        self.voted = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # At the end of a committed step only: not after a micro-batch that does not step (with accumulation, a heal
        # moves global_step mid-step, and a batch ends at step 0 with no optimizer state yet: a StopIteration out of
        # a hook would end Lightning's epoch), nor after a discarded step (global_step did not move).
        voted, self.voted = self.voted, False
        if trainer.global_rank != 0 or not voted or trainer.global_step in (self.last, 0):
            return
        self.last = trainer.global_step
        loop = trainer.fit_loop.epoch_loop
        opt_state = next(iter(trainer.optimizers[0].state.values()))
        record = {
            "step": trainer.global_step,
            "pid": os.getpid(),
            "time": time.time(),
            "weights": digest(pl_module.state_dict()),
            "optimizer": digest(trainer.optimizers[0].state_dict()),
            "scheduler": digest(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "adam_steps": int(opt_state["step"]) if "step" in opt_state else None,  # SGD keeps no count
            "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "rng": digest([torch.get_rng_state(), np.random.get_state()[1], random.getstate()]),
            "callback": self.batches.seen,
            "loop": [trainer.global_step, loop._batches_that_stepped, trainer.current_epoch],
            "samples": batch[2].tolist(),
            "accumulate": trainer.accumulate_grad_batches,
            "step_samples": self.closed,
        }
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


class PauseAt(Callback):
    """At committed step ``step``: wait until the durable and the memory tier's saves in flight are committed, write
    ``<out>/paused`` and stop stepping (the heartbeats go on) until the test kills the group: a whole-job failure at a
    known step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        trainer.strategy.checkpoint_wait()
        memory = trainer.strategy._memory  # the memory tier's callback (a test script reaches in)
        if memory is not None:
            # Its hook may come after this one: issue the step's save now (it saves a step once), then wait for it.
            memory.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            memory.wait()
        (out / "paused").write_text(str(self.step))
        while True:
            time.sleep(1)


L.seed_everything(args.seed)
policies = {
    "keep_global": ElasticPolicy(batch="keep_global"),
    "keep_local": ElasticPolicy(batch="keep_local", lr_scaling="linear"),
    "keep_local_none": ElasticPolicy(batch="keep_local", lr_scaling="none"),
    "none": None,
}
policy = {} if args.policy == "default" else {"elastic": policies[args.policy]}
if args.strategy == "ddp":  # the oracle: one torchrun job of several processes
    strategy = DDPStrategy()
elif args.strategy == "elastic":  # one job without replica groups, on the resumable sampler's stream
    strategy = ElasticFT3D(**policy)
else:
    groups = ReplicaGroups(
        address="127.0.0.1",
        min_replicas=args.min_replicas,
        timeout=timedelta(seconds=args.timeout_s),
        lighthouse_wait=timedelta(seconds=args.lighthouse_wait_s),
    )
    memory = MemoryTier(every_n_train_steps=args.memory_every) if args.memory_every else None
    fault = FaultPolicy()  # the strategy's default
    if args.evict_on == "health_check":
        fault = FaultPolicy(health_check_every_n_steps=args.health_every, health_check_action="evict")
    strategy = ElasticFT3D(replica_groups=groups, memory_tier=memory, fault=fault, **policy)
batches = Batches()
callbacks = [batches, Record(batches)]
if args.evict_on:
    nvml = FakeNVML(device_count=1)
    callbacks.append(SickDevice(nvml, args.evict_on, args.sick_from))
    if args.evict_on == "health_check":
        strategy._fault.nvml = nvml  # the health checks' NVML seam (tests/fault/fault_script.py does the same)
    else:
        callbacks.append(ThermalMonitor(interval=2, evict_after=2, nvml=nvml, devices=[0] * 8, action="evict"))
if args.evict_stragglers:
    callbacks.append(StragglerMonitor(interval=4, warmup_steps=2, patience=2, action="evict"))
if args.pause_at:
    callbacks.append(PauseAt(args.pause_at))
if args.ckpt_dir:
    callbacks.append(SaveDelay())
    checkpoint = ModelCheckpoint(
        dirpath=args.ckpt_dir,
        every_n_train_steps=args.every_n,
        save_top_k=args.top_k,
        monitor="step" if args.monitor_step else None,  # the same in every group (a loss is each group's own)
        mode="max",
        save_last=args.save_last or None,
    )
    callbacks.append(checkpoint)
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy,
    max_steps=args.max_steps,
    accumulate_grad_batches=args.accumulate,
    precision="64-true" if args.deterministic else "32-true",
    limit_val_batches=0,
    enable_checkpointing=bool(args.ckpt_dir),
    logger=CSVLogger(str(out), name="csv", version=0),
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=callbacks,
)
trainer.fit(Model())
torch.save(trainer.lightning_module.state_dict(), out / f"final{trainer.global_rank}.pt")
if trainer.global_rank == 0 and args.ckpt_dir:  # what each group's ModelCheckpoint holds (a heal copies it)
    (out / "checkpoint_state.json").write_text(json.dumps(checkpoint.state_dict(), default=str))
if trainer.global_rank == 0:
    (out / "done.json").write_text(json.dumps({"global_step": trainer.global_step, "pid": os.getpid()}))
