"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.fault` (docs/); these may change in any release. The architecture test allows this module to be
imported only by the packages that may import ``fault`` (tests/test_architecture.py, ``ALLOWED``) and by the tests.

The strategy runs one :class:`FaultHandler` per ``fit`` and records the attempt's end with :func:`end_attempt`. The
monitors evict a node with :func:`evict_node` (and check at setup that they can, :func:`check_can_evict`); the CLI's
``health-gate`` reads a node's record with :func:`check_record`.

Each name is imported on first use from the module that defines it, so that ``health-gate``, which needs only the
health record (:mod:`~lightning_ft.fault.health_record`, standard library only), imports neither Lightning nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ft.fault.eviction import SOURCES, agent_pid, check_can_evict, evict_node, replica_sync
    from lightning_ft.fault.fault_handler import FaultHandler, end_attempt
    from lightning_ft.fault.health_record import (
        NODE_UNAVAILABLE_EXIT_CODE,
        HealthRecord,
        check_record,
        read_record,
        record_path,
        write_record,
    )
    from lightning_ft.fault.injector import InjectedFault
    from lightning_ft.fault.watchdog import HANG_EXIT_CODE
    from lightning_ft.stop import attempt_end_fields, checkpoint_and_stop

# Module names relative to this package, so that lightning_ft.pytorch_lightning's copy imports its own modules.
_EXPORTS = {
    "FaultHandler": ".fault_handler",
    "HANG_EXIT_CODE": ".watchdog",
    "NODE_UNAVAILABLE_EXIT_CODE": ".health_record",
    "SOURCES": ".eviction",
    "agent_pid": ".eviction",
    "HealthRecord": ".health_record",
    "check_can_evict": ".eviction",
    "check_record": ".health_record",
    "evict_node": ".eviction",
    "replica_sync": ".eviction",
    "read_record": ".health_record",
    "record_path": ".health_record",
    "write_record": ".health_record",
    "InjectedFault": ".injector",
    "attempt_end_fields": "..stop",
    "checkpoint_and_stop": "..stop",
    "end_attempt": ".fault_handler",
}

__all__ = [
    "FaultHandler",
    "HANG_EXIT_CODE",
    "NODE_UNAVAILABLE_EXIT_CODE",
    "SOURCES",
    "HealthRecord",
    "agent_pid",
    "check_can_evict",
    "check_record",
    "evict_node",
    "replica_sync",
    "read_record",
    "record_path",
    "write_record",
    "InjectedFault",
    "attempt_end_fields",
    "checkpoint_and_stop",
    "end_attempt",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__.rpartition(".")[0]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
