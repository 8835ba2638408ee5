"""The demo's monitors and its two injected incidents, on CPU.

A CPU has no NVML, so ThermalMonitor reads a ``FakeNVML``. On the attempt after the restart, from
``--incident-step`` on, rank 1's fake device reports a thermal slowdown at a quarter of its maximum SM clock, and rank
1's steps slow down by the same ratio, as a throttled GPU's kernels would: ThermalMonitor logs a ``thermal`` event on
rank 1 and StragglerMonitor names rank 1 as a straggler, with the step the slowdown began.
"""

from __future__ import annotations

import argparse
import os
import time

from lightning.pytorch.callbacks import Callback

from lightning_ft import GoodputMonitor, StragglerMonitor, ThermalMonitor
from lightning_ft.nvml import FakeNVML


class ThermalIncident(Callback):
    """Throttles rank ``rank``'s fake device from ``step`` on, and makes that rank's steps slower by the clock ratio:
    each step waits (ratio - 1) times the rank's own previous step, as a throttled GPU's kernels would take longer,
    however slow or busy the machine running the demo is."""

    def __init__(self, nvml: FakeNVML, *, rank: int, step: int) -> None:
        self.nvml = nvml
        self.rank = rank
        self.step = step
        self._started = 0.0
        self._last_step_s = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        after_restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        if after_restart and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            if not self.nvml.is_throttled(trainer.local_rank):
                print(f"[demo] rank {self.rank}: device throttles (thermal slowdown) at step {trainer.global_step}")
                self.nvml.throttle(trainer.local_rank, "HwThermalSlowdown", sm_clock_mhz=495.0, temperature_c=93.0)
            reading = self.nvml.read(trainer.local_rank)
            time.sleep(self._last_step_s * (reading["max_sm_clock_mhz"] / reading["sm_clock_mhz"] - 1.0))
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._last_step_s = time.perf_counter() - self._started


def monitor_callbacks(args: argparse.Namespace) -> list[Callback]:
    nvml = FakeNVML(device_count=2)
    return [
        StragglerMonitor(interval=4),  # short windows: the demo's last attempt is 90 steps long
        ThermalMonitor(nvml=nvml, interval=8),
        GoodputMonitor(),
        ThermalIncident(nvml, rank=1, step=args.incident_step),
    ]
