"""Every rank learns, at the same step boundary, that some rank received a preemption signal.

A signal reaches one rank, several or all of them, at any moment; stopping must happen at the same step on every rank,
or the next collective deadlocks. At a *check* boundary every rank contributes ``(signal time, signal number, proposed
interval)`` to one ``all_gather`` of three float64 per rank, on a gloo group of its own (CPU tensors: no device sync,
and the training group's collectives never interleave with it).

Two things keep the cost off the step:

- the gather is pipelined: the one started at a check is read at the next check, so no rank waits for the others to
  reach it;
- checks are spaced ``interval`` optimizer steps apart, about ``budget_s`` of training (at most
  ``max_interval`` steps; every step when steps are longer than the budget). Each rank proposes an interval from its own
  recent step time and every rank adopts the smallest proposal of the gather it reads, so all ranks keep the same
  schedule without another collective. Between checks a boundary costs an integer comparison.

Every rank reads the same gathered values at the same boundary, so every rank decides the same. A signal is acted upon
within two checks: at most ``2 * interval`` steps, about ``2 * budget_s`` plus a step. Outside torch.distributed (one
process) the local flag decides at every boundary. ``benchmarks/preemption_agreement.py`` measures the cost against a
synchronous all-reduce per step (docs/fault-tolerance.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from lightning_ft.fault.signals import PreemptionSignals

Rows = list[tuple[float, ...]]
Gather = Callable[[tuple[float, float, float]], Callable[[], Rows]]
"""Starts a gather of this rank's row; returns the function that waits for every rank's rows."""


@dataclass(frozen=True)
class StopDecision:
    """What the ranks agreed: some rank received a preemption signal."""

    signal_time: float
    """Unix time of the first signal seen on any rank."""
    signum: int
    """The number of that first signal."""
    signal_ranks: tuple[int, ...]
    """Every rank that had received a signal when the ranks agreed."""


def decide(rows: Rows) -> StopDecision | None:
    """The decision from every rank's ``(signal time or NaN, signal number or 0, ...)``; ``None`` when no rank has one."""
    seen = [(t, int(s), rank) for rank, (t, s, *_) in enumerate(rows) if not math.isnan(t)]
    if not seen:
        return None
    first_time, first_signum, _ = min(seen)
    return StopDecision(signal_time=first_time, signum=first_signum, signal_ranks=tuple(r for _, _, r in seen))


class _GlooGather:
    """Pipelined all-gathers of three float64 per rank, with preallocated double buffers."""

    def __init__(self, group: dist.ProcessGroup | None, world_size: int) -> None:
        self._group = group
        self._rows = [np.zeros(3) for _ in range(2)]  # written through numpy: no torch dispatch per check
        self._inputs = [torch.from_numpy(r) for r in self._rows]
        self._outputs = [[torch.empty(3, dtype=torch.float64) for _ in range(world_size)] for _ in range(2)]
        self._turn = 0

    def __call__(self, row: tuple[float, float, float]) -> Callable[[], Rows]:
        turn, self._turn = self._turn, 1 - self._turn
        self._rows[turn][:] = row
        out = self._outputs[turn]
        work = dist.all_gather(out, self._inputs[turn], group=self._group, async_op=True)

        def wait() -> Rows:
            work.wait()
            return [tuple(float(v) for v in t.numpy()) for t in out]

        return wait


class StopAgreement:
    """The agreement on preemption. Collective: every rank calls :meth:`poll` at every optimizer-step boundary and
    :meth:`now` at the same points, in the same order; both return the same decision on every rank.

    Args:
        signals: this rank's recorded signals.
        group: a gloo group for the agreement; ``None`` creates one when torch.distributed is initialized with more
            than one rank (then construction is collective), else the local flag decides.
        timeout: timeout of the group created here.
        budget_s: training time between two checks, about (see the module docstring).
        max_interval: most optimizer steps between two checks.
        gather: replaces the collective (tests drive the schedule on one process with it).
        clock: monotonic time source for the step time (tests inject one).
    """

    def __init__(
        self,
        signals: PreemptionSignals,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        budget_s: float = 1.0,
        max_interval: int = 10,
        gather: Gather | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._signals = signals
        self._budget_s = budget_s
        self._max_interval = max_interval
        self._clock = clock
        self._owns_group = False
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if gather is None and distributed:
            self._owns_group = group is None
            if self._owns_group:
                group = dist.new_group(backend="gloo", timeout=timeout)
            gather = _GlooGather(group, dist.get_world_size(group))
        self._group = group
        self._gather = gather
        self._pending: Callable[[], Rows] | None = None
        self._boundary = 0
        self._next_check = 1
        self.interval = 1
        """Optimizer steps between two checks, the same on every rank."""
        self._last_check: tuple[int, float] | None = None
        self.decision: StopDecision | None = None
        """Set once the ranks agreed to stop."""

    def _local(self) -> tuple[float, float]:
        received = self._signals.received
        return (math.nan, 0.0) if received is None else (received.time, float(received.signum))

    def _proposal(self) -> float:
        now = self._clock()
        last, self._last_check = self._last_check, (self._boundary, now)
        if last is None or self._boundary == last[0]:
            return 1.0
        step_s = (now - last[1]) / (self._boundary - last[0])
        steps = int(self._budget_s / step_s) if step_s > 0 else self._max_interval
        return float(min(max(steps, 1), self._max_interval))

    def _read(self, rows: Rows) -> StopDecision | None:
        decision = decide(rows)
        if decision is None:
            self.interval = max(1, min(int(r[2]) for r in rows))
        self.decision = decision
        return decision

    def poll(self) -> StopDecision | None:
        """Called at every optimizer-step boundary. At a check, reads the gather started at the previous check and
        starts the next one; between checks, does nothing. Blocks only if a peer has not started the previous gather."""
        if self.decision is not None:
            return self.decision
        if self._gather is None:
            self.decision = decide([self._local()])
            return self.decision
        self._boundary += 1
        if self._boundary < self._next_check:
            return None
        pending, self._pending = self._pending, None
        if pending is not None and self._read(pending()) is not None:
            return self.decision
        self._pending = self._gather((*self._local(), self._proposal()))
        self._next_check = self._boundary + self.interval
        return None

    def now(self) -> StopDecision | None:
        """A synchronous agreement (after validation, at the end of training): reads the pending gather, then gathers
        the current flags. Blocks until every rank calls it; checks resume at the next boundary."""
        if self.decision is not None or self._gather is None:
            return self.poll() if self.decision is None else self.decision
        pending, self._pending = self._pending, None
        if pending is not None and self._read(pending()) is not None:
            return self.decision
        self._read(self._gather((*self._local(), self._proposal()))())
        self._next_check = self._boundary + 1
        return self.decision

    def close(self, *, wait: bool = True) -> None:
        """Wait for a pending gather (every rank started it) and release the group. Every rank calls it.

        ``wait=False`` (teardown after an error, when a peer may be gone) leaves both to the process exit: waiting on
        or destroying a group whose peer died can block.
        """
        pending, self._pending = self._pending, None
        if not wait:
            return
        if pending is not None:
            pending()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._owns_group = False
