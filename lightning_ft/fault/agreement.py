"""Every rank learns, at the same step boundary, that some rank received a preemption signal.

A signal reaches one rank, several or all of them, at any moment; stopping must happen at the same step on every rank,
or the next collective deadlocks. At each step boundary every rank contributes ``(signal time, signal number)`` (or
nothing) to one ``all_gather`` of two float64 per rank, on a gloo group of its own (CPU tensors: no device sync, and
the training group's collectives never interleave with it).

The gather is pipelined: the one started at boundary *k* is read at boundary *k + 1*, so no rank waits for it while
the other ranks finish their step; every rank reads the same values, so every rank decides the same. The price is one
step of latency: a signal is acted upon at the second step boundary after it arrives (the first if it arrives before
the gather of that boundary starts). ``benchmarks/preemption_agreement.py`` measures the cost against a synchronous
all-reduce and a check every *k* steps (docs/fault-tolerance.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_ft.fault.signals import PreemptionSignals


@dataclass(frozen=True)
class StopDecision:
    """What the ranks agreed: some rank received a preemption signal."""

    signal_time: float
    """Unix time of the first signal seen on any rank."""
    signum: int
    """The number of that first signal."""
    signal_ranks: tuple[int, ...]
    """Every rank that had received a signal when the ranks agreed."""


def decide(rows: list[tuple[float, float]]) -> StopDecision | None:
    """The decision from every rank's ``(signal time or NaN, signal number or 0)``; ``None`` when no rank has one."""
    seen = [(t, int(s), rank) for rank, (t, s) in enumerate(rows) if not math.isnan(t)]
    if not seen:
        return None
    first_time, first_signum, _ = min(seen)
    return StopDecision(signal_time=first_time, signum=first_signum, signal_ranks=tuple(r for _, _, r in seen))


class StopAgreement:
    """The per-step agreement on preemption. Collective: every rank calls :meth:`poll` at every step boundary, and
    :meth:`now` at the same points, in the same order.

    Args:
        signals: this rank's recorded signals.
        group: a gloo group for the agreement; ``None`` creates one when torch.distributed is initialized (then
            construction is collective), and works on this rank alone otherwise.
        timeout: timeout of the group created here.
    """

    def __init__(
        self, signals: PreemptionSignals, *, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        self._signals = signals
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self._owns_group = group is None and self._distributed
        if self._owns_group:
            group = dist.new_group(backend="gloo", timeout=timeout)
        self._group = group
        self._world_size = dist.get_world_size(group) if self._distributed else 1
        self._pending: tuple[object, list[torch.Tensor]] | None = None
        self.decision: StopDecision | None = None
        """Set once the ranks agreed to stop."""

    def _row(self) -> torch.Tensor:
        received = self._signals.received
        if received is None:
            return torch.tensor([math.nan, 0.0], dtype=torch.float64)
        return torch.tensor([received.time, float(received.signum)], dtype=torch.float64)

    def _start(self) -> tuple[object, list[torch.Tensor]]:
        out = [torch.empty(2, dtype=torch.float64) for _ in range(self._world_size)]
        work = dist.all_gather(out, self._row(), group=self._group, async_op=True)
        return work, out

    @staticmethod
    def _finish(pending: tuple[object, list[torch.Tensor]]) -> StopDecision | None:
        work, out = pending
        work.wait()  # type: ignore[attr-defined]
        return decide([(float(t[0]), float(t[1])) for t in out])

    def poll(self) -> StopDecision | None:
        """Read the gather started at the previous call and start the next one. Returns the decision to stop, the
        same on every rank, or ``None``. Blocks only if a peer has not started the previous gather yet."""
        if self.decision is not None:
            return self.decision
        if not self._distributed:
            self.decision = decide([self._local()])
            return self.decision
        decision = self._finish(self._pending) if self._pending is not None else None
        self._pending = None
        if decision is not None:
            self.decision = decision
            return decision
        self._pending = self._start()
        return None

    def now(self) -> StopDecision | None:
        """A synchronous agreement (at validation end and train end): reads the pending gather, then gathers the
        current flags. Blocks until every rank calls it."""
        if self.decision is not None:
            return self.decision
        if not self._distributed:
            return self.poll()
        decision = self._finish(self._pending) if self._pending is not None else None
        self._pending = None
        if decision is None:
            decision = self._finish(self._start())
        self.decision = decision
        return decision

    def _local(self) -> tuple[float, float]:
        row = self._row()
        return float(row[0]), float(row[1])

    def close(self, *, wait: bool = True) -> None:
        """Wait for a pending gather (every rank started it) and release the group. Every rank calls it.

        ``wait=False`` (teardown after an error, when a peer may be gone) leaves both to the process exit: waiting on
        or destroying a group whose peer died can block.
        """
        pending, self._pending = self._pending, None
        if not wait:
            return
        if pending is not None:
            pending[0].wait()  # type: ignore[attr-defined]
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._owns_group = False
