"""The training process of benchmarks/replica_recovery.py: one rank, launched by torchrun, in either mode.

- ``--mode restart``: ``ElasticFT3D`` without replica groups (the data-parallel world is one torchrun job that
  ``--max-restarts`` relaunches whole), a memory-tier copy every ``--memory-every`` steps and a durable checkpoint
  every ``--ckpt-every`` steps, auto-resume from the newest;
- ``--mode replica``: ``ElasticFT3D(replica_groups=ReplicaGroups(...))``, one group per torchrun job (the lighthouse,
  group id and group count come from ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``), no checkpoints.

What it writes under ``--out`` (the benchmark reads it back):

- ``pid_rank<RANK>`` at the first line, before any import: the pid the benchmark SIGKILLs;
- ``starts.jsonl`` (every rank): ``{pid, rank, process_start, first_line, imported}``: the process's start (from
  ``/proc``), its first line, and the time once ``torch`` and ``lightning`` are imported;
- ``steps.jsonl`` (rank 0): ``{step, time, pid, samples}`` once per committed step (``samples``: the samples that
  step trained across this job's ranks).

Every step sleeps ``--step-sleep`` seconds (a stand-in for compute that does not compete for the shared cores).
While ``<out>/hang_rank<RANK>`` exists that rank's training step does not return (a hung rank: torchft's heartbeats
go on). The run stops at the step written in ``--stop-file`` once it exists (every rank reads the same number, so the ranks and the
groups stop at the same step).
"""

from __future__ import annotations

import os
import sys
import time

FIRST_LINE = time.time()
_RANK = os.environ.get("RANK", "0")


def _process_start() -> float:
    """This process's start, to 10 ms: ``/proc/uptime`` less the process's age in clock ticks. (``/proc/stat``'s
    ``btime`` is whole seconds, so a start computed from it can be up to 1 s early.)"""
    with open("/proc/uptime") as f, open("/proc/self/stat") as g:
        uptime = float(f.read().split()[0])
        ticks = int(g.read().rsplit(")", 1)[1].split()[19])
    return FIRST_LINE - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


PROCESS_START = _process_start()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("restart", "replica"), required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--stop-file", required=True)
parser.add_argument("--step-sleep", type=float, default=0.1)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--memory-every", type=int, default=5)
parser.add_argument("--ckpt-every", type=int, default=50)
parser.add_argument("--timeout-s", type=float, default=None, help="ReplicaGroups.timeout (default: its default)")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
(out / f"pid_rank{_RANK}").write_text(str(os.getpid()))

import lightning as L  # noqa: E402
import torch  # noqa: E402

IMPORTED = time.time()

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_ft import ElasticFT3D  # noqa: E402

with open(out / "starts.jsonl", "a") as f:
    record = {"pid": os.getpid(), "rank": int(_RANK), "process_start": PROCESS_START}
    f.write(json.dumps(record | {"first_line": FIRST_LINE, "imported": IMPORTED}) + "\n")


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        time.sleep(args.step_sleep)
        while (out / f"hang_rank{_RANK}").exists():
            time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        data = TensorDataset(torch.randn(400_000, 16, generator=g), torch.randn(400_000, 4, generator=g))
        return DataLoader(data, batch_size=args.batch_size, shuffle=True)


class Record(Callback):
    """Rank 0: one line per committed step; every rank: stop at the step in the stop file."""

    def __init__(self) -> None:
        self.last = -1
        self.stop_at: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            if trainer.global_rank == 0:
                samples = args.batch_size * trainer.world_size
                line = {"step": trainer.global_step, "time": time.time(), "pid": os.getpid(), "samples": samples}
                with open(out / "steps.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
        if self.stop_at is None and os.path.exists(args.stop_file):
            text = Path(args.stop_file).read_text().strip()
            self.stop_at = int(text) if text else None
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            trainer.should_stop = True


torch.set_num_threads(1)
L.seed_everything(0)
callbacks: list[Callback] = [Record()]
if args.mode == "replica":
    from datetime import timedelta

    from lightning_ft import ElasticPolicy, ReplicaGroups

    timeout = {} if args.timeout_s is None else {"timeout": timedelta(seconds=args.timeout_s)}
    groups = ReplicaGroups(address="127.0.0.1", min_replicas=1, **timeout)
    # The per-group batch kept through an outage (as torchft does; what the benchmark measured): three groups of
    # accumulation 1 cannot keep the global batch at two.
    keep_local = ElasticPolicy(batch="keep_local", lr_scaling="none")
    strategy = ElasticFT3D(replica_groups=groups, elastic=keep_local)
else:
    from lightning_ft import MemoryTier

    strategy = ElasticFT3D(memory_tier=MemoryTier(every_n_train_steps=args.memory_every))
    callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=1))
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=strategy,
    max_steps=10**9,
    limit_val_batches=0,
    enable_checkpointing=args.mode == "restart",
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=str(out),
    callbacks=callbacks,
)
trainer.fit(Model())
