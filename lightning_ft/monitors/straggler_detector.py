"""The straggler decision, as a pure function of per-rank window statistics (no torch, no process group).

:class:`~lightning_ft.monitors.straggler_monitor.StragglerMonitor` measures every rank and gathers one number per rank
per window (the median of the rank's own step time: data wait plus compute, collective waits excluded); this module
decides from those numbers alone, so that the benchmark harness (``benchmarks/straggler_detection.py``) can feed it
synthetic or recorded timings for 2 to 1024 ranks and measure detection latency and false alarms without starting
processes. Every rank of a run feeds the same gathered numbers to its own detector, so all ranks reach the same
decision without a second collective.

The bar a rank must clear adapts to the fleet: the detector measures how much each rank's ratio to the others moves
from one window to the next (the noise of the fleet's own measurements) and names a rank only when its excess is
``noise_factor`` times that noise, and never less than ``threshold``. On a quiet cluster the fixed ``threshold``
decides; on a busy host, where a healthy rank's window median swings by 20% or more from window to window, the bar
rises with the noise instead of naming a different rank every few windows.

Beside that one-window rule, a sequential test per rank
(:class:`~lightning_ft.monitors.sequential_test.SequentialTest`, a one-sided CUSUM) lets the evidence of a persistent
slowdown smaller than the bar accumulate over windows.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lightning_ft.monitors.fleet_statistics import (
    MAD_TO_SIGMA,
    ChangeNoise,
    clipped_mean,
    median,
    medians_of_others,
    step_residuals,
    within_spread,
)
from lightning_ft.monitors.sequential_test import Evidence, SequentialTest


@dataclass(kw_only=True, frozen=True)
class DetectorConfig:
    """How slow, and for how long, a rank must be to be called a straggler."""

    threshold: float = 0.12
    """Least relative excess over the median of the other ranks that counts as slow: 0.12 means 12% slower. The bar
    in use is higher when the fleet's measured noise asks for it (``noise_factor``)."""
    patience: int = 3
    """Slow windows, among the last ``patience + 1``, before a rank is named (and good windows in a row before a
    named rank counts as recovered). Window medians already hide one-off stalls; patience hides a slow window (a
    checkpoint, a garbage collection) that hits one rank only."""
    min_excess_ms: float = 0.5
    """Absolute excess (milliseconds) a slow rank must also have, so sub-millisecond noise on tiny steps is ignored."""
    drift_threshold: float = 0.2
    """Relative slowdown of a rank against its own baseline, net of any slowdown of the whole fleet, that counts as
    drift (a rank that used to be faster than the others and is now slower than them, though by less than
    ``threshold``). ``math.inf`` turns drift off; so does a fleet noisy enough to lift the bar above ``threshold``."""
    baseline_windows: int = 3
    """Windows that form each rank's baseline for drift (the median of their window medians)."""
    noise_factor: float = 3.0
    """How many noise units a slow rank's excess must reach. The noise unit is the fleet's window-to-window spread
    of log(own time / median of the others), estimated robustly over the last ``noise_windows`` windows; the bar in
    use is ``max(threshold, exp(noise_factor * noise) - 1)``. 0 turns the adaptation off (the fixed ``threshold``
    alone, as in 0.1.0)."""
    noise_windows: int = 32
    """Recent windows over which the noise is measured (a window-to-window change per window)."""
    min_noise_windows: int = 6
    """Window-to-window changes measured before anybody can be named (``min_noise_windows + 1`` windows after
    warm-up). Fewer would judge the noise from a stretch in which one healthy rank happened to stay slow: on a busy
    host that lasts several windows."""

    cusum_shift: float = 0.15
    """The persistent relative excess the sequential test is tuned for (0.15: 15% slower than the others): a window
    adds ``(statistic - allowance) / noise`` to the rank's sum, the allowance being half of ``log1p(cusum_shift)``
    (the allowance that detects a shift of ``cusum_shift`` soonest for a given rate of false alarms)."""
    cusum_slack: float = 0.0
    """Least allowance, in noise units (0: half of ``log1p(cusum_shift)`` alone). A higher value keeps a healthy rank
    that merely runs a little behind from accumulating anything on a very noisy host, at the price of not seeing a
    shift smaller than twice the slack."""
    cusum_limit: float = 12.0
    """Noise units a rank's sum must reach to name it (and its mirror to clear it); one window adds at most
    ``cusum_limit / cusum_windows``. ``math.inf`` turns the sequential test off (the one-window rule alone, as in 0.2.0)."""
    cusum_windows: int = 4
    """Least windows the sequential test needs to name a rank: one window adds at most ``cusum_limit /
    cusum_windows``. On a busy host a healthy rank can run 1.3-2x behind the others for three windows (the host's
    doing, not the rank's); capping what one window adds keeps such a burst from reaching the limit alone."""
    cusum_min_noise: float = 0.02
    """Least noise unit of the sequential test, in log ratio: a quiet fleet measures a noise near 0."""
    cusum_clip: float = 1.5
    """Per-step clipping of the sequential test's statistic, in units of the per-step noise: a window's statistic is
    the mean of its steps' log ratios to the others, each clipped to this many per-step noise units around the
    rank's baseline, so one descheduled time slice adds bounded evidence. ``math.inf``: the plain mean."""
    baseline_lag_windows: int = 8
    """The sequential test compares a rank with its own history: its baseline is the median of its window log ratios
    from ``baseline_lag_windows + noise_windows`` to ``baseline_lag_windows`` windows ago (a rank that a host keeps a
    little slower, rank 0 doing the logging, is not a straggler), leaving out the most recent ones, so that a new
    slowdown is judged against the time before it. The baseline lies between 0 (the others' level) and
    ``log1p(cusum_shift)``; while the rank is named it stays where it was."""
    per_rank_baseline: bool = True
    """False: the sequential test compares every rank with the others at ratio 1 (no per-rank baseline)."""

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
        if not (self.noise_factor >= 0 and math.isfinite(self.noise_factor)):
            raise ValueError(f"DetectorConfig(noise_factor={self.noise_factor!r}): must be >= 0 (0 disables)")
        if self.min_noise_windows < 1:
            raise ValueError(f"DetectorConfig(min_noise_windows={self.min_noise_windows!r}): must be >= 1")
        if not self.cusum_clip > 0:
            raise ValueError(f"DetectorConfig(cusum_clip={self.cusum_clip!r}): must be > 0 (inf: no clipping)")
        if self.baseline_lag_windows < 0:
            raise ValueError(f"DetectorConfig(baseline_lag_windows={self.baseline_lag_windows!r}): must be >= 0")
        for name in ("cusum_shift", "cusum_min_noise"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"DetectorConfig({name}={getattr(self, name)!r}): must be > 0 and finite")
        if not (self.cusum_slack >= 0 and math.isfinite(self.cusum_slack)):
            raise ValueError(f"DetectorConfig(cusum_slack={self.cusum_slack!r}): must be >= 0 and finite")
        if not self.cusum_limit > 0:
            raise ValueError(f"DetectorConfig(cusum_limit={self.cusum_limit!r}): must be > 0 (inf disables)")
        if self.cusum_windows < 1:
            raise ValueError(f"DetectorConfig(cusum_windows={self.cusum_windows!r}): must be >= 1")
        if self.noise_windows < self.min_noise_windows:
            raise ValueError(
                f"DetectorConfig(noise_windows={self.noise_windows!r}): must be >= min_noise_windows"
                f" ({self.min_noise_windows})"
            )


@dataclass(frozen=True)
class Detection:
    """A rank named a straggler at the end of the window that ends at ``step``."""

    rank: int
    ratio: float
    """The rank's own time over the median of the other ranks (``kind="fleet"``), or over its baseline net of the
    fleet's own change (``kind="drift"``)."""
    onset_step: int
    """The global step during which the rank's slowdown began: the rank's own estimate of where its times rose, when
    it sent one, else the first step of the first slow window of the streak that led to this detection."""
    step: int
    kind: str
    """``"fleet"`` or ``"drift"``."""
    threshold: float = math.nan
    """The relative excess the rank had to exceed in this window (``DetectorConfig.threshold`` or more)."""
    rule: str = "window"
    """Which rule named it: ``"window"`` (slow in ``patience`` windows against the bar) or ``"cusum"`` (the
    sequential test's evidence reached ``DetectorConfig.cusum_limit``; ``ratio`` is then the geometric mean ratio
    since the onset)."""


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
    threshold: float = math.inf
    """The relative excess that counted as slow in this window; ``inf`` while the noise is still being measured."""
    noise: float = math.nan
    """The fleet's measured noise: the spread of log(own time / others' median) between windows (NaN: unknown)."""
    residuals: list[float] = field(default_factory=list)
    """Per rank: the statistic the sequential test judges, in log ratio (the relative residual where the window's
    per-step times were given, else log of ``ratios``)."""
    sequential_noise: float = math.nan
    """The noise of ``residuals`` measured the same way as ``noise`` (NaN: unknown): the sequential test's unit."""


class _Window(NamedTuple):
    """One rank's record of one window, kept for the last ``noise_windows`` windows: a streak is judged against the
    bar in use when it is named, back to where it began."""

    start: int
    log_ratio: float
    log_drift: float
    excess_ms: float
    drift_excess_ms: float
    onset_hint: float


def _log(x: float) -> float:
    return math.log(x) if math.isfinite(x) and x > 0 else math.nan


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
        self._recent: dict[int, deque[_Window]] = {}
        self._healthy: dict[int, int] = {}
        self._lost_ms: dict[int, float] = {}
        self._named: dict[int, str] = {}
        self._history: list[list[float]] = []  # window medians per rank, until baselines exist
        self._baseline: list[float] | None = None
        self._changes = ChangeNoise(self.config.noise_windows, self.config.min_noise_windows)
        self._residual_changes = ChangeNoise(self.config.noise_windows, self.config.min_noise_windows)
        self._levels: list[deque[float]] = []  # per rank, its window residuals (NaN while named)
        self._step_spread: deque[float] = deque(maxlen=self.config.noise_windows)
        self._frozen: dict[int, float] = {}
        self._last_baselines: list[float] = []
        cfg = self.config
        self._sequential = SequentialTest(
            shift=cfg.cusum_shift,
            slack=cfg.cusum_slack,
            limit=cfg.cusum_limit,
            min_noise=cfg.cusum_min_noise,
            per_window=cfg.cusum_limit / cfg.cusum_windows,
            min_excess_ms=cfg.min_excess_ms,
        )

    @property
    def named(self) -> dict[int, str]:
        """Ranks currently named, with the kind of detection."""
        return dict(self._named)

    @property
    def noise(self) -> float:
        """The fleet's measured noise (see :attr:`DetectorConfig.noise_factor`); NaN until enough windows."""
        return self._changes.noise()

    def thresholds(self) -> tuple[float, float]:
        """The bars in use, in log(ratio): ``(fleet, drift)``; ``inf`` while the noise is still unknown."""
        cfg = self.config
        fleet, drift = math.log1p(cfg.threshold), math.log1p(cfg.drift_threshold)
        if cfg.noise_factor == 0:
            return fleet, drift
        noise = self.noise
        if not math.isfinite(noise):
            return math.inf, math.inf
        bar = cfg.noise_factor * noise
        if bar > fleet:
            # Drift compares a rank with a baseline of a few early windows; where the noise already lifts the fleet
            # bar above `threshold`, that baseline may have caught a healthy rank in a fast phase, and a drift of
            # `drift_threshold` cannot be told from noise: drift is not judged while the fleet is this noisy.
            return bar, math.inf
        # The drift statistic carries the noise of the window and of the baseline.
        return fleet, max(drift, bar * math.sqrt(2.0))

    def update(
        self,
        own_ms: Sequence[float],
        *,
        step: int,
        steps: int,
        onset_steps: Sequence[float] | None = None,
        step_own_ms: Sequence[Sequence[float]] | None = None,
    ) -> WindowResult:
        """Feed one window: ``own_ms[r]`` for each rank, the window ended when the global step reached ``step`` and
        covered the ``steps`` steps before it.

        ``onset_steps[r]``, where given and finite, is rank ``r``'s own estimate of the global step at which its times
        rose (the monitor sends the best split of its last two windows' step times); it becomes the detection's
        ``onset_step`` when it lies within the first slow window of the streak or the window before it.

        ``step_own_ms[r]``, where given, is rank ``r``'s own time at each step of the window, every rank's ``s``-th
        entry the same global step: the sequential test then judges each rank by its relative residual (the median
        over the window of its time over the others' at the same step), whose noise on a busy host is a fraction
        of the window medians' (see :func:`~lightning_ft.monitors.fleet_statistics.relative_residuals`).
        """
        cfg = self.config
        n = len(own_ms)
        others = medians_of_others(own_ms)
        ratios = [o / m if math.isfinite(o) and m > 0 else math.nan for o, m in zip(own_ms, others, strict=True)]
        log_ratios = [_log(r) for r in ratios]
        self._changes.append_from(log_ratios)
        if step_own_ms is not None and len(step_own_ms) != n:
            raise ValueError(f"step_own_ms has {len(step_own_ms)} ranks, own_ms {n}")
        residuals, levels = self._sequential_statistics(log_ratios, step_own_ms)
        self._residual_changes.append_from(residuals)
        sequential_noise = self._residual_changes.noise()
        drift = self._drift_ratios(own_ms)
        bar_fleet, bar_drift = self.thresholds()
        result = WindowResult(
            fleet_median_ms=median(own_ms),
            ratios=ratios,
            threshold=math.expm1(bar_fleet),
            noise=self.noise,
            residuals=residuals,
            sequential_noise=sequential_noise,
        )
        start = step - steps
        hints = list(onset_steps) if onset_steps is not None else [math.nan] * n
        least = cfg.min_excess_ms
        for rank, own in enumerate(own_ms):
            d = drift[rank]
            window = _Window(
                start,
                # Slow in a window by both measures: the ratio of window medians, and the median of its steps'
                # ratios to the others at the same step. On a busy host the first alone runs 1.3-1.6x for a few
                # windows when another rank is favoured by the scheduler (the swings the ranks share stay in it);
                # step by step they cancel.
                min(log_ratios[rank], levels[rank]) if math.isfinite(levels[rank]) else log_ratios[rank],
                # Drift counts only once the rank is slower than the others: a rank that slowed down but still
                # arrives first at the collective holds nobody back.
                _log(d) if ratios[rank] > 1.0 else math.nan,
                own - others[rank],
                own - own / d if d > 0 else math.nan,
                hints[rank],
            )
            recent = self._recent.get(rank)
            if recent is None:
                recent = self._recent[rank] = deque(maxlen=max(cfg.noise_windows, cfg.patience + 1))
            recent.append(window)
            slow_fleet = window.log_ratio > bar_fleet and window.excess_ms > least
            slow_drift = window.log_drift > bar_drift and window.drift_excess_ms > least
            if self._sequential.clearing(rank):
                # Named by the sequential test: it recovers by the same kind of evidence, not by the window rule,
                # whose bar a 15% slowdown on a loaded host never reaches.
                self._lost_ms[rank] = self._lost_ms.get(rank, 0.0) + max(window.excess_ms, 0.0) * steps
                if math.isfinite(bar_fleet) and self._sequential.clear(rank, residuals[rank], noise=sequential_noise):
                    del self._named[rank]
                    self._healthy.pop(rank, None)
                    result.recoveries.append(Recovery(rank, step, self._lost_ms.pop(rank, 0.0) / 1000.0))
                continue
            evidence = None
            if not self._sequential.enabled or not math.isfinite(bar_fleet) or rank in self._named:
                self._sequential.forget(rank)
            else:
                evidence = self._sequential.add(
                    rank,
                    residuals[rank],
                    window.excess_ms,
                    steps,
                    noise=sequential_noise,
                    window=window,
                    level=levels[rank],
                )
            if slow_fleet or slow_drift:
                self._lost_ms[rank] = self._lost_ms.get(rank, 0.0) + max(window.excess_ms, 0.0) * steps
                self._healthy.pop(rank, None)
            elif rank in self._named:
                # Hysteresis: a named rank recovers after `patience` good windows, so one good window in a slow
                # episode does not split it into two detections.
                self._healthy[rank] = self._healthy.get(rank, 0) + 1
                if self._healthy[rank] >= cfg.patience:
                    del self._named[rank], self._healthy[rank]
                    result.recoveries.append(Recovery(rank, step, self._lost_ms.pop(rank, 0.0) / 1000.0))
                continue
            else:
                if self._lost_ms:
                    self._lost_ms.pop(rank, None)
                if evidence is not None:
                    result.detections.append(self._name_by_evidence(rank, evidence, steps, step, bar_fleet))
                continue  # the window rule needs the latest window slow
            if rank in self._named:
                continue
            # `patience` slow windows among the last `patience + 1`, judged against the bar in use now: one unlucky
            # window delays a detection by one window instead of restarting it.
            for kind, is_slow, ratio in (("fleet", slow_fleet, ratios[rank]), ("drift", slow_drift, d)):
                if not is_slow:
                    continue
                flags = [_slow(w, kind, bar_fleet, bar_drift, least) for w in recent]
                if sum(flags[-(cfg.patience + 1) :]) >= cfg.patience:
                    self._named[rank] = kind
                    first = recent[_streak_start(flags)]
                    bar = bar_fleet if kind == "fleet" else bar_drift
                    result.detections.append(Detection(rank, ratio, _onset(first, steps), step, kind, math.expm1(bar)))
                    self._sequential.forget(rank)
                    break
            else:
                if evidence is not None:
                    result.detections.append(self._name_by_evidence(rank, evidence, steps, step, bar_fleet))
        # A named rank keeps the baseline it had when named; a cleared one follows its history again.
        for rank in self._named:
            if rank not in self._frozen and rank < len(self._last_baselines):
                self._frozen[rank] = self._last_baselines[rank]
        for rank in [r for r in self._frozen if r not in self._named]:
            del self._frozen[rank]
        return result

    def _sequential_statistics(
        self, log_ratios: list[float], step_own_ms: Sequence[Sequence[float]] | None
    ) -> tuple[list[float], list[float]]:
        """Per rank, the sequential test's statistic for this window (the clipped mean of its steps' log ratios to
        the others, or the window's log ratio without per-step times, less its baseline) and the median of its
        steps' log ratios to the others (the window's log ratio without per-step times)."""
        cfg = self.config
        n = len(log_ratios)
        per_step = step_residuals(step_own_ms) if step_own_ms is not None else [[x] for x in log_ratios]
        levels = [median(x) for x in per_step]
        baselines = self._baselines(n)
        # A named rank's slow windows stay out of its own history: they are not its normal level.
        if len(self._levels) != n:
            self._levels = [deque(maxlen=cfg.noise_windows + cfg.baseline_lag_windows) for _ in range(n)]
        for rank, (history, v) in enumerate(zip(self._levels, levels, strict=True)):
            history.append(math.nan if rank in self._named else v)
        if step_own_ms is None:
            return [x - b for x, b in zip(log_ratios, baselines, strict=True)], levels
        spread = within_spread(per_step)
        if math.isfinite(spread):
            self._step_spread.append(spread)
        if len(self._step_spread) < cfg.min_noise_windows:
            return [m - b for m, b in zip(levels, baselines, strict=True)], levels
        clip = cfg.cusum_clip * max(median(self._step_spread) * MAD_TO_SIGMA, cfg.cusum_min_noise)
        return [clipped_mean(x, b, clip) for x, b in zip(per_step, baselines, strict=True)], levels

    def _baselines(self, n: int) -> list[float]:
        cfg = self.config
        out = []
        for rank in range(n):
            if rank in self._frozen:
                out.append(self._frozen[rank])
                continue
            history = self._levels[rank] if rank < len(self._levels) else ()
            values = [v for v in list(history)[: max(len(history) - cfg.baseline_lag_windows, 0)] if math.isfinite(v)]
            level = median(values) if cfg.per_rank_baseline and len(values) >= cfg.min_noise_windows else 0.0
            # Never below the others (a rank that is usually faster and now merely keeps up holds nobody back),
            # and never more than the excess the test is tuned for (a rank slow from the start is still judged).
            out.append(min(max(level, 0.0), math.log1p(cfg.cusum_shift)))
        self._last_baselines = out
        return out

    def _name_by_evidence(self, rank: int, ev: Evidence, steps: int, step: int, bar_fleet: float) -> Detection:
        self._named[rank] = "fleet"
        self._sequential.named(rank)
        self._healthy.pop(rank, None)
        self._lost_ms[rank] = max(self._lost_ms.get(rank, 0.0), ev.lost_ms)
        return Detection(rank, ev.ratio, _onset(ev.first, steps), step, "fleet", math.expm1(bar_fleet), rule="cusum")

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


def _slow(w: _Window, kind: str, bar_fleet: float, bar_drift: float, least: float) -> bool:
    if kind == "fleet":
        return w.log_ratio > bar_fleet and w.excess_ms > least
    return w.log_drift > bar_drift and w.drift_excess_ms > least


def _streak_start(flags: list[bool]) -> int:
    """Index of the first slow window of the streak that ends with the last window: walking back, the streak ends at
    two healthy windows in a row (one is the unlucky window that patience forgives)."""
    first = len(flags) - 1
    for i in range(len(flags) - 2, -1, -1):
        if flags[i]:
            first = i
        elif i == 0 or not flags[i - 1]:
            break
    return first


def _onset(first_slow: _Window, steps: int) -> int:
    hint = first_slow.onset_hint
    if math.isfinite(hint) and first_slow.start - steps <= hint < first_slow.start + steps:
        return int(hint)
    return first_slow.start
