"""Fault handling: preemption signals, hang watchdog, pre-flight and periodic health checks and a fault injector.

``FaultPolicy`` configures it; ``ElasticFT3D(fault=FaultPolicy())`` (the default) runs it through one fault handler
per ``fit``; ``fault=None`` turns all of it off. See docs/fault-tolerance.md, which teaches the public names below;
the strategy's glue (the handler, the attempt's end record) is in :mod:`lightning_ft.fault.internal` (not API).
"""

from lightning_ft.fault.fault_policy import FaultPolicy
from lightning_ft.fault.health import HealthCheckError
from lightning_ft.fault.injector import FaultInjector, checkpoint_storage
from lightning_ft.stop import CheckpointedStop

__all__ = [
    "CheckpointedStop",
    "FaultInjector",
    "FaultPolicy",
    "HealthCheckError",
    "checkpoint_storage",
]
