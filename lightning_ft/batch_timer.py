"""Where the wall time between training batches goes: productive time, data wait and checkpoint stalls.

One :class:`BatchTimer` per consumer (the strategy's progress events, ``GoodputMonitor``'s totals), fed from the
``on_train_batch_start``/``on_train_batch_end`` hooks. Productive time runs from a batch's start hook to its end hook;
the gap before a batch is data wait, except the part a checkpoint save blocked the loop, which is a stall: measured,
when the caller knows it (the strategy times its own save calls), or estimated as the gap's excess over the median of
recent ordinary gaps.

Under ``ElasticFT3D`` one timer serves both: the strategy's tracker drives it and writes its drains as ``progress``
lines (``lightning-ft report`` sums them), and ``GoodputMonitor`` logs its totals, so the report and the logger show
the same figures (:meth:`lightning_ft.events.EventLog.claim`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple


class Drained(NamedTuple):
    """What a :class:`BatchTimer` accumulated since its previous drain."""

    productive_s: float
    data_wait_s: float
    stall_s: float


class BatchTimer:
    """Accumulates productive, data-wait and stall seconds over training batches. Not thread-safe; one rank's loop.

    Example::

        timer = BatchTimer()
        timer.batch_start()
        ...  # the training step
        timer.batch_end()
        productive_s, data_wait_s, stall_s = timer.drain()  # since the previous drain
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, recent_gaps: int = 32) -> None:
        self._clock = clock
        self.productive_s = 0.0
        """Seconds inside batches since construction."""
        self.data_wait_s = 0.0
        """Seconds waiting between batches (for data) since construction."""
        self.stall_s = 0.0
        """Seconds between batches that a checkpoint save blocked the loop, since construction."""
        self._drained = Drained(0.0, 0.0, 0.0)
        self._batch_start: float | None = None
        self._last_end: float | None = None
        self._gaps: deque[float] = deque(maxlen=recent_gaps)

    def epoch_start(self, *, count_wait: bool) -> None:
        """A new epoch begins. ``count_wait``: the wait for its first batch (iterator start-up, workers) is data wait;
        otherwise that gap is not counted at all."""
        self._last_end = self._clock() if count_wait else None

    def pause(self) -> None:
        """Something that is not training runs before the next batch (validation): the next gap is not counted."""
        self._last_end = None

    def batch_start(self, *, stall_s: float | None = None, saved: bool = False) -> None:
        """A batch starts. ``stall_s``: seconds of the gap that a save measured itself; else ``saved`` says a save
        ran in the gap, and its stall is estimated from the usual gap."""
        now = self._clock()
        if self._last_end is not None:
            gap = now - self._last_end
            if stall_s is not None:
                stall = min(max(stall_s, 0.0), gap)
            elif saved and self._gaps:
                stall = max(gap - statistics.median(self._gaps), 0.0)
            else:
                stall = 0.0
                self._gaps.append(gap)
            self.data_wait_s += gap - stall
            self.stall_s += stall
        self._batch_start = now

    def batch_end(self) -> None:
        now = self._clock()
        if self._batch_start is not None:
            self.productive_s += now - self._batch_start
        self._batch_start = None
        self._last_end = now

    def add_stall(self, seconds: float) -> None:
        """Book ``seconds`` of a save that blocked the loop after the last batch (no next batch start will): the save
        at the end of training."""
        self.stall_s += max(seconds, 0.0)

    def totals(self) -> Drained:
        """Everything accumulated since construction."""
        return Drained(self.productive_s, self.data_wait_s, self.stall_s)

    def drain(self) -> Drained:
        """``(productive_s, data_wait_s, stall_s)`` accumulated since the previous call."""
        previous, self._drained = self._drained, self.totals()
        return Drained(*(now - before for now, before in zip(self._drained, previous, strict=True)))

    def pending(self) -> bool:
        """Whether anything accumulated since the last :meth:`drain`."""
        return self.totals() != self._drained
