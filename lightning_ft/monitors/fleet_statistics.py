"""Robust statistics of one number per rank, as the straggler monitor gathers them: medians, the median of the other
ranks, and the diagnosis of a named rank (which part of its step exceeds the others'). Pure: no torch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


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


PARTS = ("data", "compute", "backward")
"""The parts of a step that :func:`diagnose` compares: data wait, compute outside backward (forward, loss, optimizer
step), and backward (its compute plus, under DDP, the wait for the gradient all-reduce)."""


def diagnose(windows: Sequence[Mapping[str, Sequence[float]]], rank: int) -> tuple[str, dict[str, float]]:
    """Which part of ``rank``'s step holds the others back: ``("data" | "compute", excess)``.

    ``windows`` are the windows of the slow episode, each mapping a part of :data:`PARTS` to one median per rank
    (milliseconds). ``excess[part]`` is the median over the windows of the rank's time in that part less the median
    of the others'. The part that grew is the larger excess of the two parts of its own time (data wait, compute);
    ``excess["backward"]`` is normally negative for the slow rank: it arrives last at the all-reduce and waits least,
    while the others' longer backward is their wait for it. ``("unknown", {})`` without windows.
    """
    excess: dict[str, float] = {}
    for part in PARTS:
        per_window = []
        for w in windows:
            values = list(w.get(part, ()))
            if rank < len(values) and math.isfinite(values[rank]):
                per_window.append(values[rank] - medians_of_others(values)[rank])
        excess[part] = median(per_window)
    own = {p: excess[p] for p in ("data", "compute") if math.isfinite(excess[p])}
    if not own:
        return "unknown", {}
    return max(own, key=lambda p: own[p]), {p: v for p, v in excess.items() if math.isfinite(v)}
