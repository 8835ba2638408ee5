"""The demo's monitors and its two injected incidents, on CPU.

A CPU has no NVML, so ThermalMonitor reads a ``FakeNVML``. On the attempt after the restart, from
``--incident-step`` on, rank 1's fake device reports a thermal slowdown at 60% of its maximum SM clock, and rank 1's
steps slow down by the same ratio, as a throttled GPU's kernels would: ThermalMonitor logs a ``thermal`` event on rank
1 and StragglerMonitor names rank 1 as a straggler.
"""

from __future__ import annotations

import argparse
import os
import time

from lightning.pytorch.callbacks import Callback

from lightning_ft import GoodputMonitor, StragglerMonitor, ThermalMonitor
from lightning_ft.monitors.nvml import FakeNVML


class ThermalIncident(Callback):
    """Throttles rank ``rank``'s fake device from ``step`` on, and makes that rank's steps slower by the clock ratio."""

    def __init__(self, nvml: FakeNVML, *, rank: int, step: int, base_ms: float) -> None:
        self.nvml = nvml
        self.rank = rank
        self.step = step
        self.base_ms = base_ms

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        after_restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if not after_restart or trainer.global_rank != self.rank or trainer.global_step < self.step:
            return
        if not self.nvml.is_throttled(trainer.local_rank):
            print(f"[demo] rank {self.rank}: device throttles (thermal slowdown) at step {trainer.global_step}")
            self.nvml.throttle(trainer.local_rank, "HwThermalSlowdown", sm_clock_mhz=840.0, temperature_c=91.0)
        reading = self.nvml.read(trainer.local_rank)
        time.sleep(self.base_ms * (reading["max_sm_clock_mhz"] / reading["sm_clock_mhz"] - 1.0) / 1000.0)


def monitor_callbacks(args: argparse.Namespace) -> list[Callback]:
    nvml = FakeNVML(device_count=2)
    return [
        StragglerMonitor(),
        ThermalMonitor(nvml=nvml, interval=8),
        GoodputMonitor(),
        ThermalIncident(nvml, rank=1, step=args.incident_step, base_ms=40.0),
    ]
