"""Fault handling: preemption signals, hang watchdog, pre-flight and periodic health checks and a fault injector.

``FaultPolicy`` configures it; ``ElasticFT3D(fault=FaultPolicy())`` (the default) runs it through one fault handler
per ``fit``; ``fault=None`` turns all of it off. See docs/fault-tolerance.md, which teaches the public names below;
the strategy's glue (the handler, the attempt's end record) is in :mod:`lightning_ft.fault.internal` (not API).

The names are imported on first use, so that ``lightning-ft health-gate`` (:mod:`~lightning_ft.fault.health_record`,
one JSON file read before every launch) imports neither Lightning nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ft.fault.fault_policy import FaultPolicy
    from lightning_ft.fault.health import HealthCheckError
    from lightning_ft.fault.injector import FaultInjector, checkpoint_storage
    from lightning_ft.stop import CheckpointedStop

# Module names relative to this package, so that lightning_ft.pytorch_lightning's copy imports its own modules.
_EXPORTS = {
    "CheckpointedStop": "..stop",
    "FaultInjector": ".injector",
    "FaultPolicy": ".fault_policy",
    "HealthCheckError": ".health",
    "checkpoint_storage": ".injector",
}

__all__ = [
    "CheckpointedStop",
    "FaultInjector",
    "FaultPolicy",
    "HealthCheckError",
    "checkpoint_storage",
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
