"""Fault handling: preemption signals, hang watchdog, pre-flight health checks and a fault injector.

``FaultPolicy`` configures it; ``ElasticFT3D(fault=FaultPolicy())`` (the default) runs it through one
:class:`~lightning_ft.fault.fault_handler.FaultHandler` per ``fit``; ``fault=None`` turns all of it off.
See docs/fault-tolerance.md.
"""

from lightning_ft.fault.fault_handler import FaultHandler, end_attempt
from lightning_ft.fault.fault_policy import FaultPolicy
from lightning_ft.fault.health import HealthCheckError
from lightning_ft.fault.injector import FaultInjector, InjectedFault, checkpoint_storage
from lightning_ft.fault.watchdog import HANG_EXIT_CODE
from lightning_ft.stop import CheckpointedStop, attempt_end_fields, checkpoint_and_stop

__all__ = [
    "CheckpointedStop",
    "FaultHandler",
    "FaultInjector",
    "FaultPolicy",
    "HANG_EXIT_CODE",
    "HealthCheckError",
    "InjectedFault",
    "attempt_end_fields",
    "checkpoint_and_stop",
    "checkpoint_storage",
    "end_attempt",
]
