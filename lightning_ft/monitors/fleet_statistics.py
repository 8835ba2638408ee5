"""Robust statistics of one number per rank, as the straggler monitor gathers them: medians, the median of the other
ranks, and the diagnosis of a named rank (which part of its step exceeds the others'). Pure: no torch."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its median absolute deviation


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


def step_residuals(step_ms: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per rank and step, log(its own time / the median of the others' at that step); NaN where unknown.

    ``step_ms[r][s]`` is rank ``r``'s own time at the window's ``s``-th step; every rank's ``s``-th step is the same
    global step (data parallel runs in lockstep). On a busy host most of a step's swing is the host's (a time
    slice, the others' collective): comparing each step with the others' time at the same step cancels what the
    ranks share.
    """
    n = len(step_ms)
    steps = min((len(s) for s in step_ms), default=0)
    out: list[list[float]] = [[math.nan] * steps for _ in range(n)]
    for s in range(steps):
        logs = [math.log(r[s]) if math.isfinite(r[s]) and r[s] > 0 else math.nan for r in step_ms]
        for rank, other in enumerate(medians_of_others(logs)):
            if math.isfinite(logs[rank]) and math.isfinite(other):
                out[rank][s] = logs[rank] - other
    return out


def relative_residuals(step_ms: Sequence[Sequence[float]]) -> list[float]:
    """Per rank, the median over the window's steps of :func:`step_residuals`: the median ignores the steps one
    rank lost to a descheduled slice. NaN for a rank with no step where it and at least one other rank measured a
    positive time."""
    return [median(v) for v in step_residuals(step_ms)]


def clipped_mean(values: Sequence[float], center: float, clip: float) -> float:
    """Mean of ``values - center``, each clipped to ``[-clip, clip]`` (NaN entries skipped; NaN when none): one
    outlying step moves it by at most ``clip / n``, where the median would ignore it and the plain mean follow it."""
    kept = [min(max(v - center, -clip), clip) for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else math.nan


def within_spread(per_rank: Sequence[Sequence[float]]) -> float:
    """The median absolute deviation of every step from its own rank's median over the window, pooled over the
    ranks (NaN without values): the step-to-step noise, untouched by a rank's level, which a straggler shifts."""
    deviations = []
    for values in per_rank:
        m = median(values)
        deviations += [abs(v - m) for v in values if math.isfinite(v)]
    return median(deviations)


class ChangeNoise:
    """The noise of one number per rank per window, from its window-to-window changes: the median over the ranks of
    the absolute change, its median over the last ``windows`` windows, scaled to a standard deviation.

    A persistent straggler changes its number once, at its onset, and so barely moves these medians; the busy host's
    swings, which come and go, are what they measure. NaN until ``least`` changes were measured.
    """

    def __init__(self, windows: int, least: int) -> None:
        self._changes: deque[float] = deque(maxlen=windows)
        self._least = least
        self._last: list[float] | None = None

    def append_from(self, values: Sequence[float]) -> None:
        """Measure the change from the previous window's values to these."""
        last, self._last = self._last, list(values)
        if last is None or len(last) != len(values):
            return
        changes = [abs(a - b) for a, b in zip(values, last, strict=True) if math.isfinite(a) and math.isfinite(b)]
        if changes:
            self._changes.append(median(changes))

    def noise(self) -> float:
        if len(self._changes) < self._least:
            return math.nan
        return median(self._changes) * MAD_TO_SIGMA / math.sqrt(2.0)


def rise_step(steps: Sequence[int], values: Sequence[float], *, min_t: float = 3.0) -> float:
    """The step at which ``values`` (step times, in step order) rose to a higher level and stayed there; NaN when
    there are fewer than 4 values or no rise stands out of the noise.

    The split maximises the between-level variance of the log times (a single mean-shift change point), so one slow
    step in the middle of a window does not look like the start of a slowdown; it counts only when the rise is
    ``min_t`` standard errors or more (the best split of noise alone reaches 3 in about one window in twenty). O(n).
    """
    pairs = [(s, math.log(v)) for s, v in zip(steps, values, strict=True) if math.isfinite(v) and v > 0]
    n = len(pairs)
    if n < 4:
        return math.nan
    xs = [x for _, x in pairs]
    total, total_sq = sum(xs), sum(x * x for x in xs)
    best_k, best_score, before, before_sq = 0, 0.0, 0.0, 0.0
    for k in range(1, n):
        before += xs[k - 1]
        before_sq += xs[k - 1] ** 2
        low, high = before / k, (total - before) / (n - k)
        if high <= low:
            continue
        # Within-level variance, pooled; the rise in units of its standard error.
        within = (before_sq - k * low * low + (total_sq - before_sq) - (n - k) * high * high) / max(n - 2, 1)
        score = (high - low) / math.sqrt(max(within, 1e-12) * (1 / k + 1 / (n - k)))
        if score > best_score:
            best_k, best_score = k, score
    return float(pairs[best_k][0]) if best_score >= min_t else math.nan


def _waits(backward: Sequence[float]) -> list[float]:
    finite = [b for b in backward if math.isfinite(b)]
    least = min(finite) if finite else math.nan
    return [b - least for b in backward]


PARTS = ("data", "compute", "backward")
"""The parts of a step that :func:`diagnose` compares: data wait, compute outside backward (forward, loss, optimizer
step), and backward (its compute plus, under DDP, the wait for the gradient all-reduce)."""


def diagnose(windows: Sequence[Mapping[str, Sequence[float]]], rank: int) -> tuple[str, dict[str, float]]:
    """Which part of ``rank``'s step holds the others back: ``("data" | "compute", excess)``.

    ``windows`` are the windows of the slow episode, each mapping a part of :data:`PARTS` to one median per rank
    (milliseconds). ``excess[part]`` is the median over the windows of the rank's time in that part less the median
    of the others'. The part that grew is the larger excess of the two parts of its own time (data wait, compute);
    ``excess["backward"]`` is normally negative for the slow rank: it arrives last at the all-reduce and waits least,
    while the others' longer backward is their wait for it. ``excess["wait"]`` is the same seen as waiting: each
    rank's backward less the fleet's shortest (the rank that arrives last barely waits), the rank's less the
    others'; a straggler's is negative by about its own excess. ``("unknown", {})`` without windows.
    """
    excess: dict[str, float] = {}
    for part in (*PARTS, "wait"):
        per_window = []
        for w in windows:
            values = list(w.get(part, ())) if part != "wait" else _waits(w.get("backward", ()))
            if rank < len(values) and math.isfinite(values[rank]):
                per_window.append(values[rank] - medians_of_others(values)[rank])
        excess[part] = median(per_window)
    own = {p: excess[p] for p in ("data", "compute") if math.isfinite(excess[p])}
    if not own:
        return "unknown", {}
    return max(own, key=lambda p: own[p]), {p: v for p, v in excess.items() if math.isfinite(v)}
