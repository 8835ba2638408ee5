"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.fault` (docs/); these may change in any release. The architecture test allows this module to be
imported only by the packages that may import ``fault`` (tests/test_architecture.py, ``ALLOWED``) and by the tests.

The strategy runs one :class:`FaultHandler` per ``fit`` and records the attempt's end with :func:`end_attempt`. The
monitors evict a node with :func:`evict_node` (and check at setup that they can, :func:`check_can_evict`); the CLI's
``health-gate`` reads a node's record with :func:`check_record`.
"""

from lightning_ft.fault.eviction import (
    NODE_UNAVAILABLE_EXIT_CODE,
    SOURCES,
    HealthRecord,
    check_can_evict,
    check_record,
    evict_node,
    read_record,
    record_path,
    write_record,
)
from lightning_ft.fault.fault_handler import FaultHandler, end_attempt
from lightning_ft.fault.injector import InjectedFault
from lightning_ft.fault.watchdog import HANG_EXIT_CODE
from lightning_ft.stop import attempt_end_fields, checkpoint_and_stop

__all__ = [
    "FaultHandler",
    "HANG_EXIT_CODE",
    "NODE_UNAVAILABLE_EXIT_CODE",
    "SOURCES",
    "HealthRecord",
    "check_can_evict",
    "check_record",
    "evict_node",
    "read_record",
    "record_path",
    "write_record",
    "InjectedFault",
    "attempt_end_fields",
    "checkpoint_and_stop",
    "end_attempt",
]
