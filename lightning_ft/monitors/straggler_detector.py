"""The straggler decision, as a pure function of per-rank window statistics (no torch, no process group).

:class:`~lightning_ft.monitors.straggler_monitor.StragglerMonitor` measures every rank and gathers one number per rank
per window (the median of the rank's own step time: data wait plus compute, collective waits excluded); this module
decides from those numbers alone, so that the benchmark harness (``benchmarks/straggler_detection.py``) can feed it
synthetic timings for 8 to 1024 ranks and measure detection latency and false positives without starting processes.
Every rank of a run feeds the same gathered numbers to its own detector, so all ranks reach the same decision without
a second collective.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class DetectorConfig:
    """How slow, and for how long, a rank must be to be called a straggler."""

    threshold: float = 0.12
    """Relative excess over the median of the other ranks that counts as slow: 0.12 means 12% slower."""
    patience: int = 3
    """Slow windows, among the last ``patience + 1``, before a rank is named (and good windows in a row before a
    named rank counts as recovered). Window medians already hide one-off stalls; patience hides a slow window (a
    checkpoint, a garbage collection) that hits one rank only."""
    min_excess_ms: float = 0.5
    """Absolute excess (milliseconds) a slow rank must also have, so sub-millisecond noise on tiny steps is ignored."""
    drift_threshold: float = 0.2
    """Relative slowdown of a rank against its own baseline, net of any slowdown of the whole fleet, that counts as
    drift (a rank that used to be faster than the others and is now slower than them, though by less than
    ``threshold``). ``math.inf`` turns drift off."""
    baseline_windows: int = 3
    """Windows that form each rank's baseline for drift (the median of their window medians)."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"DetectorConfig(threshold={self.threshold!r}): must be > 0")
        if self.patience < 1:
            raise ValueError(f"DetectorConfig(patience={self.patience!r}): must be >= 1")
        if self.min_excess_ms < 0:
            raise ValueError(f"DetectorConfig(min_excess_ms={self.min_excess_ms!r}): must be >= 0")
        if not self.drift_threshold > 0:
            raise ValueError(f"DetectorConfig(drift_threshold={self.drift_threshold!r}): must be > 0 (inf disables)")
        if self.baseline_windows < 1:
            raise ValueError(f"DetectorConfig(baseline_windows={self.baseline_windows!r}): must be >= 1")


@dataclass(frozen=True)
class Detection:
    """A rank named a straggler at the end of the window that ends at ``step``."""

    rank: int
    ratio: float
    """The rank's own time over the median of the other ranks (``kind="fleet"``), or over its baseline net of the
    fleet's own change (``kind="drift"``)."""
    onset_step: int
    """First step of the first slow window of the streak that led to this detection."""
    step: int
    kind: str
    """``"fleet"`` or ``"drift"``."""


@dataclass(frozen=True)
class Recovery:
    """A named rank that is no longer slow, with the time the fleet lost waiting for it since its onset."""

    rank: int
    step: int
    lost_s: float


@dataclass
class WindowResult:
    """What one window decided."""

    fleet_median_ms: float
    ratios: list[float]
    """Per rank: own time over the median of the other ranks (NaN where a rank reported nothing)."""
    detections: list[Detection] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)


def median(values: Sequence[float]) -> float:
    """Median of the finite values; NaN when there are none."""
    finite = sorted(v for v in values if math.isfinite(v))
    n = len(finite)
    if n == 0:
        return math.nan
    mid = n // 2
    return finite[mid] if n % 2 else 0.5 * (finite[mid - 1] + finite[mid])


def medians_of_others(values: Sequence[float]) -> list[float]:
    """For each entry, the median of all other finite entries (NaN for a non-finite entry or a lone rank).

    Comparing a rank with the others rather than with a median that includes it keeps a 20% slower rank at ratio 1.2
    even with two ranks, where the plain median would sit halfway between them. O(n log n).
    """
    order = sorted((v, i) for i, v in enumerate(values) if math.isfinite(v))
    s = [v for v, _ in order]
    n = len(s)
    out = [math.nan] * len(values)
    if n < 2:
        return out
    m = n - 1  # size of "the others"

    def pick(k: int, removed: int) -> float:
        return s[k] if k < removed else s[k + 1]

    for pos, (_, i) in enumerate(order):
        if m % 2:
            out[i] = pick(m // 2, pos)
        else:
            out[i] = 0.5 * (pick(m // 2 - 1, pos) + pick(m // 2, pos))
    return out


class StragglerDetector:
    """Names ranks whose own step time stays above the rest of the fleet, or drifts above their own baseline.

    Call :meth:`update` once per window with one number per rank (the median of its own time over the window, in
    milliseconds, NaN where unknown). Deterministic: ranks fed the same numbers decide the same.

    Example::

        detector = StragglerDetector(DetectorConfig(threshold=0.12, patience=3))
        for end_step in range(10, 200, 10):
            result = detector.update([100.0, 100.0, 125.0, 100.0], step=end_step, steps=10)
            for d in result.detections:
                print(f"rank {d.rank} is {d.ratio:.2f}x slower since step {d.onset_step}")
    """

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self._recent: dict[tuple[int, str], deque[bool]] = {}
        self._healthy: dict[int, int] = {}
        self._onset: dict[tuple[int, str], int] = {}
        self._lost_ms: dict[int, float] = {}
        self._named: dict[int, str] = {}
        self._history: list[list[float]] = []  # window medians per rank, until baselines exist
        self._baseline: list[float] | None = None

    @property
    def named(self) -> dict[int, str]:
        """Ranks currently named, with the kind of detection."""
        return dict(self._named)

    def update(self, own_ms: Sequence[float], *, step: int, steps: int) -> WindowResult:
        """Feed one window: ``own_ms[r]`` for each rank, the window ended at ``step`` and covered ``steps`` steps."""
        cfg = self.config
        others = medians_of_others(own_ms)
        ratios = [o / m if math.isfinite(o) and m > 0 else math.nan for o, m in zip(own_ms, others, strict=True)]
        fleet = median(own_ms)
        result = WindowResult(fleet_median_ms=fleet, ratios=ratios)
        drift = self._drift_ratios(own_ms)
        start = step - steps + 1
        for rank, own in enumerate(own_ms):
            slow = {
                "fleet": math.isfinite(ratios[rank])
                and ratios[rank] > 1 + cfg.threshold
                and own - others[rank] > cfg.min_excess_ms,
                # Drift counts only once the rank is slower than the others: a rank that slowed down but still
                # arrives first at the collective holds nobody back.
                "drift": drift[rank] > 1 + cfg.drift_threshold
                and own - own / drift[rank] > cfg.min_excess_ms
                and ratios[rank] > 1.0,
            }
            for kind, is_slow in slow.items():
                key = (rank, kind)
                recent = self._recent.setdefault(key, deque(maxlen=cfg.patience + 1))
                recent.append(is_slow)
                if is_slow:
                    self._onset.setdefault(key, start)
                elif not any(recent):
                    self._onset.pop(key, None)
            if slow["fleet"] or slow["drift"]:
                self._lost_ms[rank] = self._lost_ms.get(rank, 0.0) + max(own - others[rank], 0.0) * steps
                self._healthy.pop(rank, None)
            elif rank in self._named:
                # Hysteresis: a named rank recovers after `patience` good windows, so one good window in a slow
                # episode does not split it into two detections.
                self._healthy[rank] = self._healthy.get(rank, 0) + 1
                if self._healthy[rank] >= cfg.patience:
                    del self._named[rank], self._healthy[rank]
                    result.recoveries.append(Recovery(rank, step, self._lost_ms.pop(rank, 0.0) / 1000.0))
            else:
                self._lost_ms.pop(rank, None)
            if rank in self._named:
                continue
            for kind, ratio in (("fleet", ratios[rank]), ("drift", drift[rank])):
                # `patience` slow windows among the last `patience + 1`: one unlucky window (a window median of a
                # slow rank that happens to dip under the threshold) delays a detection by one window, not restarts it.
                recent = self._recent.get((rank, kind), ())
                if recent and recent[-1] and sum(recent) >= cfg.patience:
                    self._named[rank] = kind
                    result.detections.append(Detection(rank, ratio, self._onset[(rank, kind)], step, kind))
                    break
        return result

    def open_episodes(self) -> dict[int, float]:
        """Named ranks that have not recovered, with the seconds lost to each so far."""
        return {rank: self._lost_ms.get(rank, 0.0) / 1000.0 for rank in self._named}

    def _drift_ratios(self, own_ms: Sequence[float]) -> list[float]:
        n = len(own_ms)
        if not math.isfinite(self.config.drift_threshold):
            return [math.nan] * n
        if self._baseline is None or len(self._baseline) != n:
            if any(math.isfinite(v) for v in own_ms):
                self._history.append(list(own_ms))
            if len(self._history) < self.config.baseline_windows:
                return [math.nan] * n
            self._baseline = [median([w[r] for w in self._history]) for r in range(n)]
            self._history = []
            return [math.nan] * n
        # Each rank's change against its own baseline, over the change of the other ranks: a slowdown of the
        # whole fleet (a longer sequence, a shared filesystem stall) cancels out.
        change = [
            own / base if base > 0 and math.isfinite(own) else math.nan
            for own, base in zip(own_ms, self._baseline, strict=True)
        ]
        return [
            c / o if math.isfinite(c) and o > 0 else math.nan
            for c, o in zip(change, medians_of_others(change), strict=True)
        ]
