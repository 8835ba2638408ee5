"""The straggler detector's sequential test: one-sided CUSUMs that let evidence of a small, persistent slowdown
accumulate over windows.

A bar that rises with the fleet's measured noise cannot see a persistent slowdown smaller than itself, and on a
loaded host that is most of them. For each rank this keeps Page's cumulative sum of its log ratio to the median of
the others, in units of the fleet's measured noise, less an allowance (half the shift it is tuned for, or
``cusum_slack`` noise units if that is more); the sum never drops below zero, so evidence accumulates while the rank
stays above the others and drains away while it does not. The rank is named when its sum reaches ``cusum_limit``,
and the sum restarts. A named rank is cleared by the mirrored sum (its evidence of being back below the allowance)
reaching the same limit. Pure: :class:`~lightning_ft.monitors.straggler_detector.StragglerDetector` feeds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Evidence:
    """One rank's open cumulative sum, since the window ``first`` (when it last left zero)."""

    first: Any
    """The detector's record of that window (its start step and the rank's onset estimate)."""
    total: float = 0.0
    windows: int = 0
    log_ratio_sum: float = 0.0
    lost_ms: float = 0.0
    """Milliseconds the others waited for the rank since ``first`` (its excess times the window's steps)."""

    @property
    def ratio(self) -> float:
        """The geometric mean ratio to the others since ``first``."""
        return math.exp(self.log_ratio_sum / self.windows)


class SequentialTest:
    """The cumulative sums of every rank of one detector.

    Args:
        shift: the relative excess the test is tuned for (``DetectorConfig.cusum_shift``).
        slack: least allowance per window, in noise units.
        limit: noise units a sum must reach (``math.inf``: never).
        min_noise: least noise unit, in log ratio.
        per_window: most one window may add (``limit / DetectorConfig.cusum_windows``).
        min_excess_ms: a window whose excess is no more than this adds no evidence.
    """

    def __init__(
        self, *, shift: float, slack: float, limit: float, min_noise: float, per_window: float, min_excess_ms: float
    ) -> None:
        self.shift, self.slack, self.limit = shift, slack, limit
        self.min_noise, self.per_window, self.min_excess_ms = min_noise, per_window, min_excess_ms
        self._open: dict[int, Evidence] = {}
        self._clearing: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.limit)

    def clearing(self, rank: int) -> bool:
        """Whether ``rank`` was named by this test and has not been cleared yet."""
        return rank in self._clearing

    def _increment(self, log_ratio: float, noise: float, sign: float) -> float:
        unit = max(noise if math.isfinite(noise) else 0.0, self.min_noise)
        allowance = max(0.5 * math.log1p(self.shift), self.slack * unit)
        z = sign * (log_ratio - allowance) / unit
        return min(max(z, -self.per_window), self.per_window)

    def add(
        self,
        rank: int,
        log_ratio: float,
        excess_ms: float,
        steps: int,
        *,
        noise: float,
        window: Any,
        level: float = math.nan,
    ) -> Evidence | None:
        """Add one window of an unnamed rank; its evidence when the sum reached the limit (the sum restarts).

        ``log_ratio`` is the statistic judged; ``level``, where finite, the rank's log ratio to the others that
        the evidence reports as its ``ratio`` (the statistic may be clipped and net of a baseline)."""
        if not math.isfinite(log_ratio):
            return None
        z = self._increment(log_ratio, noise, 1.0)
        if excess_ms <= self.min_excess_ms:
            z = min(z, 0.0)
        ev = self._open.get(rank)
        total = (ev.total if ev is not None else 0.0) + z
        if total <= 0.0:
            self._open.pop(rank, None)
            return None
        if ev is None:
            ev = self._open[rank] = Evidence(first=window)
        ev.total = total
        ev.windows += 1
        ev.log_ratio_sum += level if math.isfinite(level) else log_ratio
        ev.lost_ms += max(excess_ms, 0.0) * steps
        if total < self.limit - 1e-9:  # `patience` windows at the cap reach it, rounding aside
            return None
        del self._open[rank]
        return ev

    def named(self, rank: int) -> None:
        """The rank was named on this test's evidence: from now on :meth:`clear` judges its recovery."""
        self._clearing[rank] = 0.0

    def forget(self, rank: int) -> None:
        """Drop the rank's open sum (it was named by another rule, or cannot be judged)."""
        self._open.pop(rank, None)

    def clear(self, rank: int, log_ratio: float, *, noise: float) -> bool:
        """Add one window of a rank this test named; True (and the rank is released) once it is back."""
        if not math.isfinite(log_ratio):
            return False
        total = max(self._clearing[rank] + self._increment(log_ratio, noise, -1.0), 0.0)
        self._clearing[rank] = total
        if total < self.limit - 1e-9:
            return False
        del self._clearing[rank]
        return True
