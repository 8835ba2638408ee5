"""Per-step timing for the monitors: wall clock on CPU, CUDA events for the device part of a step on GPU.

On a GPU the host runs ahead of the device, so host timestamps taken in Lightning hooks would measure kernel launches,
not kernels. CUDA events recorded on the current stream at the same hooks measure the device; they are resolved once
per window (one ``synchronize`` on the last event), never per step. The data wait is a host-side wait and always
uses the host clock. Tests and replays pass a clock of their own (``StepClock(device, clock=fake)``), which then
times every part of a step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_ft.monitors.fleet_statistics import rise_step

__all__ = ["StepClock", "percentile", "rise_step"]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of the finite values; NaN when there are none."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return math.nan
    k = max(math.ceil(q / 100.0 * len(finite)) - 1, 0)
    return finite[k]


class StepClock:
    """Marks the phases of training steps and turns them into per-step samples (milliseconds).

    Not thread-safe: call from the training loop only.

    Args:
        device: the rank's device; on CUDA the compute and backward parts are timed with CUDA events.
        clock: seconds, monotonic; replaces the host clock and the CUDA events (tests, replays of recorded timings).
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] | None = None) -> None:
        self.cuda = clock is None and device.type == "cuda" and torch.cuda.is_available()
        self._now: Callable[[], float] = clock or time.perf_counter
        self._prev_end: float | None = None
        self._data_ms = math.nan
        self._data_is_own = True
        self._step = -1
        self._start: Any = None
        self._backward: list[list[Any]] = []
        self._pending: list[tuple[int, float, bool, Any, Any, list[list[Any]]]] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._now()

    def _ms(self, a: Any, b: Any) -> float:
        if a is None or b is None:
            return math.nan
        if self.cuda:
            return float(a.elapsed_time(b))
        return (b - a) * 1000.0

    def forget_previous_end(self) -> None:
        """The next step's data wait is unknown (an epoch start or validation came in between)."""
        self._prev_end = None

    def step_start(self, step: int = -1, *, data_is_own: bool = True) -> None:
        """A step starts; ``step`` is the global step while it runs (``trainer.global_step``), kept with its sample.

        ``data_is_own=False``: the time since the previous step held a wait for the other ranks (a collective that
        runs before the batch is fetched, when the previous step did not reduce gradients); this step's data wait
        is then unknown and its own time is its compute alone."""
        now = self._now()
        self._data_ms = (now - self._prev_end) * 1000.0 if self._prev_end is not None else math.nan
        self._data_is_own = data_is_own
        self._step = step
        self._start = self._mark()
        self._backward = []

    def backward_start(self) -> None:
        if self._start is not None:
            self._backward.append([self._mark(), None])

    def backward_end(self) -> None:
        if self._backward and self._backward[-1][1] is None:
            self._backward[-1][1] = self._mark()

    def step_end(self, *, keep: bool = True) -> None:
        """Close the step; ``keep=False`` drops it (warm-up) but still starts the next data wait here."""
        if self._start is not None and keep:
            self._pending.append(
                (self._step, self._data_ms, self._data_is_own, self._start, self._mark(), self._backward)
            )
        self._start = None
        self._backward = []
        self._prev_end = self._now()

    def drain(self) -> list[dict[str, float]]:
        """Samples of the steps closed since the last call: ``own``, ``data``, ``compute``, ``backward``, ``step``
        (milliseconds) and ``at`` (the global step it ran at)."""
        pending, self._pending = self._pending, []
        if self.cuda and pending:
            pending[-1][3].synchronize()
        samples = []
        for at, data_ms, data_is_own, start, end, backward in pending:
            span = self._ms(start, end)
            bwd = sum(self._ms(a, b) for a, b in backward if b is not None)
            compute = span - bwd
            samples.append(
                {
                    "own": data_ms + compute if data_is_own else compute,
                    "data": data_ms if data_is_own else math.nan,
                    "compute": compute,
                    "backward": bwd,
                    "step": data_ms + span,
                    "at": at,
                }
            )
        return samples
