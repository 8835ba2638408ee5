"""A tiny Lightning job with one injected slow rank, run as ``python straggler_job.py ...`` by the monitor tests.

Lightning's CPU ``ddp`` launcher re-runs this script once per extra rank. Causes: ``compute`` (rank k sleeps in
``training_step``), ``data`` (rank k sleeps in ``collate``), ``thermal`` (a fake NVML reports rank k's device
throttled and rank k's steps slow down as a throttled GPU's would), ``none``.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.monitors import FakeNVML, GoodputMonitor, StragglerMonitor, ThermalMonitor


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TinyModel(L.LightningModule):
    def __init__(self, slow_rank: int | None = None, delay_ms: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.slow_rank = slow_rank
        self.delay_ms = delay_ms

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(self.delay_ms / 1000.0)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ThrottledModel(TinyModel):
    """Slows down by the clock ratio its (fake) device reports, as a throttled GPU's kernels would."""

    def __init__(self, nvml: FakeNVML, base_ms: float) -> None:
        super().__init__()
        self.nvml = nvml
        self.base_ms = base_ms

    def training_step(self, batch, batch_idx):
        reading = self.nvml.read(self.trainer.local_rank)
        time.sleep(self.base_ms * reading["max_sm_clock_mhz"] / reading["sm_clock_mhz"] / 1000.0)
        return super().training_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--cause", choices=["compute", "data", "thermal", "none"], default="none")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--delay-ms", type=float, default=30.0)
    p.add_argument("--action", default="log")
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--interval", type=int, default=4, help="StragglerMonitor(interval=...)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def collate(samples):
        if args.cause == "data" and _rank() == args.slow_rank:
            time.sleep(args.delay_ms / 1000.0)
        return torch.utils.data.default_collate(samples)

    batch = 4
    n = args.steps * args.accumulate * args.devices * batch
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    loader = DataLoader(data, batch_size=batch, collate_fn=collate)
    nvml = FakeNVML(device_count=args.devices)
    if args.cause == "thermal":
        # The device's clock drops to a third: a throttled GPU takes three times as long for the same kernels.
        nvml.throttle(args.slow_rank, "HwThermalSlowdown", temperature_c=93.0, sm_clock_mhz=660.0)
        model: TinyModel = ThrottledModel(nvml, base_ms=args.delay_ms)
    else:
        model = TinyModel(args.slow_rank if args.cause == "compute" else None, args.delay_ms)
    callbacks = [
        StragglerMonitor(interval=args.interval, patience=2, warmup_steps=4, action=args.action),
        ThermalMonitor(interval=4, nvml=nvml),
        GoodputMonitor(),
    ]
    if args.action != "log":
        callbacks.append(ModelCheckpoint(dirpath=f"{args.root}/checkpoints", save_top_k=0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        default_root_dir=args.root,
        logger=CSVLogger(args.root, name="logs", version=0),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.action != "log",
        callbacks=callbacks,
    )
    trainer.fit(model, loader)
    # Lightning leaves the process group up after fit; tearing it down here keeps gloo's threads from aborting at exit.
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
