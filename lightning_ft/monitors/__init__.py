"""Monitors: per-rank step timing and straggler detection, GPU thermals through NVML, and goodput across restarts.

The public names are those docs/monitors.md teaches; what the CLI's ``report`` uses beyond them is in
:mod:`lightning_ft.monitors.internal` (not API). They are imported on first use, so that ``lightning-ft report``
(:mod:`~lightning_ft.monitors.goodput_report`, pure functions over the event log) imports neither Lightning nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ft.monitors.goodput_monitor import GoodputMonitor
    from lightning_ft.monitors.run_history import highest_step
    from lightning_ft.monitors.straggler_detector import DetectorConfig
    from lightning_ft.monitors.straggler_monitor import STRAGGLER_EXIT_CODE, StragglerMonitor
    from lightning_ft.monitors.thermal_monitor import ThermalMonitor
    from lightning_ft.nvml import FakeNVML

# Module names relative to this package, so that lightning_ft.pytorch_lightning's copy imports its own modules.
_EXPORTS = {
    "DetectorConfig": ".straggler_detector",
    "FakeNVML": "..nvml",
    "GoodputMonitor": ".goodput_monitor",
    "STRAGGLER_EXIT_CODE": ".straggler_monitor",
    "StragglerMonitor": ".straggler_monitor",
    "ThermalMonitor": ".thermal_monitor",
    "highest_step": ".run_history",
}

__all__ = [
    "DetectorConfig",
    "FakeNVML",
    "GoodputMonitor",
    "STRAGGLER_EXIT_CODE",
    "StragglerMonitor",
    "ThermalMonitor",
    "highest_step",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
