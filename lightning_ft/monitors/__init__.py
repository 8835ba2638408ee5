"""Monitors: per-rank step timing and straggler detection, GPU thermals through NVML, and goodput across restarts.

The public names are those docs/monitors.md teaches; what the CLI's ``report`` uses beyond them is in
:mod:`lightning_ft.monitors.internal` (not API).
"""

from lightning_ft.monitors.goodput_monitor import GoodputMonitor
from lightning_ft.monitors.run_history import highest_step
from lightning_ft.monitors.straggler_detector import DetectorConfig
from lightning_ft.monitors.straggler_monitor import STRAGGLER_EXIT_CODE, StragglerMonitor
from lightning_ft.monitors.thermal_monitor import ThermalMonitor
from lightning_ft.nvml import FakeNVML

__all__ = [
    "DetectorConfig",
    "FakeNVML",
    "GoodputMonitor",
    "STRAGGLER_EXIT_CODE",
    "StragglerMonitor",
    "ThermalMonitor",
    "highest_step",
]
