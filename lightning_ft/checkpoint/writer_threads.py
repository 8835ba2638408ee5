"""The threads of a background save and their priorities.

A save runs two pieces of work beside training. The copies of guarded tensors
(:mod:`~lightning_ft.checkpoint.capture_guard`) are on the training's critical path, because the next optimizer step
waits for them: :class:`DeferredCopy` runs them in a thread started from the caller's thread, so at the caller's
priority. The write (torchsnapshot, checksums, fsyncs, commit) is not: the writer thread lowers its own priority with
:func:`lower_thread_priority` before anything else, and the threads torchsnapshot starts from it inherit that, so
where the machine is short of cores the write takes the cycles training leaves idle.
"""

from __future__ import annotations

import logging
import os
import threading

from lightning_ft.checkpoint.capture_guard import CaptureGuard
from lightning_ft.checkpoint.staging import Capture, Stager

__all__ = ["CAPTURE_THREAD_NAME", "DeferredCopy", "lower_thread_priority"]

CAPTURE_THREAD_NAME = "lightning-ft-checkpoint-capture"

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


class DeferredCopy:
    """Makes the deferred copies of one capture in a thread of its own, started now; ends ``guard``'s wait after.

    Construct it in the thread whose priority the copies should have (the training loop's). :meth:`join` (the writer
    thread) waits for the copies and returns their error, if any.
    """

    def __init__(self, capture: Capture, guard: CaptureGuard) -> None:
        self._capture = capture
        self._guard = guard
        self._error: BaseException | None = None
        guard.begin()
        self._thread = threading.Thread(target=self._run, name=CAPTURE_THREAD_NAME, daemon=True)
        try:
            self._thread.start()
        except BaseException:
            guard.end()
            raise

    def _run(self) -> None:
        try:
            Stager.finish(self._capture)
        except BaseException as e:  # noqa: BLE001 - handed to the writer thread, which fails the save with it
            self._error = e
        finally:
            self._guard.end()

    def join(self) -> BaseException | None:
        """Wait for the copies; the error that failed them (e.g. a ``CaptureRaceError``), or ``None``."""
        self._thread.join()
        return self._error
