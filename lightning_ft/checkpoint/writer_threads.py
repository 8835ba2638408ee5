"""The priority of a background save's threads.

The write (checksums, torchsnapshot or DCP, fsyncs, commit) is off the training's critical path: the writer thread
lowers its own priority with :func:`lower_thread_priority` before anything else, and the threads torchsnapshot starts
from it inherit that, so where the machine is short of cores the write takes the cycles training leaves idle.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["lower_thread_priority"]

log = logging.getLogger(__name__)


def lower_thread_priority(niceness: int) -> bool:
    """Add ``niceness`` to the calling thread's nice value (Linux: nice is per thread). Returns whether it did.

    A no-op where the platform has no per-thread nice value; never raises (a save must not fail for it).
    """
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError as e:  # a container may forbid it; the write then runs at the caller's priority
        log.debug("lightning-ft: could not lower the checkpoint writer's priority: %s", e)
        return False
    return True
