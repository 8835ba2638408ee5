"""Monitors: per-rank step timing and straggler detection, GPU thermals through NVML, and goodput across restarts."""

from lightning_ft.monitors.goodput_monitor import GoodputMonitor
from lightning_ft.monitors.straggler_detector import DetectorConfig, StragglerDetector
from lightning_ft.monitors.straggler_monitor import STRAGGLER_EXIT_CODE, StragglerMonitor
from lightning_ft.monitors.thermal_monitor import ThermalMonitor
from lightning_ft.nvml import NVML, FakeNVML

__all__ = [
    "DetectorConfig",
    "FakeNVML",
    "GoodputMonitor",
    "NVML",
    "STRAGGLER_EXIT_CODE",
    "StragglerDetector",
    "StragglerMonitor",
    "ThermalMonitor",
]
