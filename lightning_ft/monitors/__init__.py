"""Monitors: per-rank step timing and straggler detection, GPU thermals through NVML, and goodput across restarts.

The names are imported on first use, so that ``lightning-ft report`` (:mod:`~lightning_ft.monitors.goodput_report`,
pure functions over the event log) imports neither Lightning nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ft.monitors.goodput_monitor import GoodputMonitor
    from lightning_ft.monitors.nvml import NVML, FakeNVML
    from lightning_ft.monitors.straggler_detector import DetectorConfig, StragglerDetector
    from lightning_ft.monitors.straggler_monitor import STRAGGLER_EXIT_CODE, StragglerMonitor
    from lightning_ft.monitors.thermal_monitor import ThermalMonitor

# Module names relative to this package, so that lightning_ft.pytorch_lightning's copy imports its own modules.
_EXPORTS = {
    "DetectorConfig": "straggler_detector",
    "FakeNVML": "nvml",
    "GoodputMonitor": "goodput_monitor",
    "NVML": "nvml",
    "STRAGGLER_EXIT_CODE": "straggler_monitor",
    "StragglerDetector": "straggler_detector",
    "StragglerMonitor": "straggler_monitor",
    "ThermalMonitor": "thermal_monitor",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
