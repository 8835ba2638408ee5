"""Flag-only handlers for preemption signals, installed in place of Lightning's for the duration of ``fit``.

Lightning's own SIGTERM handler broadcasts from rank 0 inside the handler and its loops then act on rank 0's flag: a
signal delivered to any other rank desynchronises the collectives and the job hangs. :class:`PreemptionSignals` puts
a handler that only records the signal (time, number, count) on each of the policy's signals; the ranks agree on it
later, at a step boundary (:mod:`~lightning_ft.fault.agreement`).

It replaces ``Trainer._signal_connector.register_signal_handlers`` with a :class:`~lightning_ft._compat.Patch`, so
Lightning's handlers are never installed while ours are (``Trainer._run`` calls it right before the training stage,
after the restore), and puts the previous handlers back at :meth:`PreemptionSignals.uninstall`, which the strategy
calls at teardown. Signals the policy does not name keep whatever handler they had.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_ft import _compat


@dataclass(frozen=True)
class ReceivedSignal:
    """The first preemption signal this process received."""

    signum: int
    """Signal number."""
    time: float
    """Unix time at which the handler ran."""

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class PreemptionSignals:
    """Records preemption signals; never does any work inside the handler.

    Args:
        signals: the signals to handle (``FaultPolicy.preemption_signals``).
        clock: Unix time source (tests inject one).

    Example::

        signals = PreemptionSignals((signal.SIGTERM, signal.SIGUSR1))
        signals.install(trainer)   # at set-up: our handlers go in where Lightning would put its own
        ...
        if signals.received is not None:
            print("preempted by", signals.received.name)
        signals.uninstall()        # at teardown
    """

    def __init__(self, signals: tuple[signal.Signals, ...], *, clock: Callable[[], float] = time.time) -> None:
        self.signals = tuple(signals)
        self._clock = clock
        self._lock = threading.Lock()
        self._received: ReceivedSignal | None = None
        self._count = 0
        self._previous: dict[int, Any] = {}
        self._patch: _compat.Patch | None = None

    @property
    def received(self) -> ReceivedSignal | None:
        """The first signal received since :meth:`reset` (``None`` if none)."""
        return self._received

    @property
    def count(self) -> int:
        """How many preemption signals arrived since :meth:`reset` (a second one changes nothing)."""
        return self._count

    def reset(self) -> None:
        with self._lock:
            self._received = None
            self._count = 0

    def handle(self, signum: int, frame: Any = None) -> None:
        """The signal handler: records the first signal's number and time, counts the rest."""
        # A signal handler runs between two bytecodes of the main thread: a non-blocking lock cannot deadlock against
        # the code it interrupted, and the watchdog thread only reads.
        now = self._clock()
        acquired = self._lock.acquire(blocking=False)
        try:
            self._count += 1
            if self._received is None:
                self._received = ReceivedSignal(signum=int(signum), time=now)
        finally:
            if acquired:
                self._lock.release()

    def install(self, trainer: Any) -> None:
        """Replace Lightning's ``register_signal_handlers`` for this trainer by :meth:`register` (idempotent)."""
        if self._patch is None and self.signals:
            self._patch = _compat.Patch(
                _compat.signal_connector(trainer),
                "register_signal_handlers",
                self.register,
                name="lightning-ft preemption signals",
            ).install()

    def register(self) -> None:
        """Put the flag-only handler on every policy signal, keeping the previous handlers (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.reset()
        for sig in self.signals:
            previous = signal.signal(sig, self.handle)
            self._previous.setdefault(int(sig), previous)

    def uninstall(self) -> None:
        """Put back the handlers :meth:`register` replaced and undo the patch. Idempotent."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                if signal.getsignal(signum) == self.handle:
                    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._previous = {}
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
