"""Goodput at a scale the run did not reach: the effective training time ratio projected to N GPUs from this run's own
checkpoint and restart costs and a published failure rate, with and without the memory tier.

Pure functions; :func:`~lightning_ft.monitors.goodput_report.summarize` calls :func:`project` with the costs it
measured (``projection`` in its result, ``lightning-ft report --project``). The model, in one place (docs/monitors.md,
"Projection", has it for users):

- The mean time to failure of a job on ``N`` GPUs is read off published points ``(N_i, MTTF_i)`` (default
  :data:`DEFAULT_MTTF_HOURS_AT`) by straight lines between them on log-log axes, ``MTTF(N) = MTTF_i * (N / N_i) **
  s`` with ``s = ln(MTTF_j / MTTF_i) / ln(N_j / N_i)`` of the segment around ``N``, extended with the slope of the
  end segment outside the points (said as ``extrapolated``); one point alone scales as ``1 / N`` (failures
  independent per GPU).
- This run's costs are taken as the costs at ``N`` GPUs (weak scaling: every GPU holds the same bytes and the save,
  load and restart take the same time): ``C`` the median stall of a periodic save of the tier, ``R`` the restart
  cost of a resume from it, the sum of the medians of ``rendezvous_s``, ``startup_s``, ``load_s`` and
  ``first_step_s`` of its ``resumed`` events (where an event lacks one, the restart record's relaunch, start-up,
  load and first-step phases). Detection is left out: it is set by the failure and the timeouts, not by the tier.
- Without the memory tier, every failure resumes from the durable tier, checkpointed every
  ``tau_d = sqrt(2 * C_d * M)`` (Young-Daly), and ``waste = C_d / tau_d + (tau_d / 2 + R_d) / M``.
- With it, a share ``f`` of failures needs the durable tier (:data:`DEFAULT_DURABLE_FRACTION`, or given) and ``1 - f``
  resume from memory: ``tau_m = sqrt(2 * C_m * M / (1 - f))``, ``tau_d = sqrt(2 * C_d * M / f)``, and
  ``waste = C_m / tau_m + C_d / tau_d + ((1 - f) * (tau_m / 2 + R_m) + f * (tau_d / 2 + R_d)) / M``.
- ``ETTR = max(1 - waste, 0)``: the first-order ratio of the time spent on training that is kept (checkpoint stalls,
  recomputed steps and restarts are the only losses counted; data waits and stragglers are not), valid while the
  intervals are well below ``M``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_ft.monitors.checkpoint_tiers import MEMORY_RESUME_TIERS, tier_of
from lightning_ft.monitors.run_history import num

DEFAULT_PROJECT_GPUS = (1024, 4096, 16384)
"""The scales ``--project`` projects to when given without a value."""
DEFAULT_MTTF_HOURS_AT = {1024: 7.9, 16384: 1.8}
"""Mean time to failure (hours) of a training job by its GPU count: the figures of Meta's 2024 study of its research
clusters (:data:`MTTF_SOURCE`)."""
MTTF_SOURCE = (
    "Kokolis et al., Revisiting Reliability in Large-Scale Machine Learning Research Clusters (Meta; arXiv 2410.21680,"
    " HPCA 2025)"
)
RESTART_PARTS = ("rendezvous_s", "startup_s", "load_s", "first_step_s")
"""The parts of a restart whose cost depends on the tier resumed from, as the ``resumed`` event names them."""
_RESTART_RECORD_PARTS = {"rendezvous_s": "relaunch_s"}
"""Where a ``resumed`` event lacks a part, the restart record's phase of that name is used instead."""


def mttf_hours(gpus: int, points: Mapping[int, float]) -> tuple[float, str]:
    """The mean time to failure at ``gpus`` GPUs from ``points`` (GPU count -> hours), and how it was read off them:
    ``"given"`` (a point), ``"interpolated"``, ``"extrapolated"`` or ``"scaled as 1/N"`` (one point only).

    Raises:
        ValueError: ``points`` is empty.
    """
    if not points:
        raise ValueError("mttf_hours(points={}): needs at least one (GPUs, hours) point")
    if gpus in points:
        return float(points[gpus]), "given"
    pts = sorted(points.items())
    if len(pts) == 1:
        n0, m0 = pts[0]
        return m0 * n0 / gpus, "scaled as 1/N"
    if gpus < pts[0][0]:
        (n0, m0), (n1, m1), how = pts[0], pts[1], "extrapolated"
    elif gpus > pts[-1][0]:
        (n0, m0), (n1, m1), how = pts[-2], pts[-1], "extrapolated"
    else:
        i = max(k for k, (n, _) in enumerate(pts) if n < gpus)
        (n0, m0), (n1, m1), how = pts[i], pts[i + 1], "interpolated"
    slope = math.log(m1 / m0) / math.log(n1 / n0)
    return m0 * (gpus / n0) ** slope, how


def restart_cost(
    resumed: Iterable[dict[str, Any]], restarts: Mapping[int, dict[str, Any]], *, memory: bool
) -> dict[str, Any]:
    """The restart cost of a resume from the memory tier (``memory=True``: ``local`` or ``peer``) or the durable one.

    Args:
        resumed: rank 0's ``resumed`` events of the run.
        restarts: the restart records by attempt (for the parts a ``resumed`` event lacks).
        memory: which tier's resumes to read.

    Returns ``resumes`` (how many), ``parts`` (part -> median seconds, ``None`` where no resume measured it),
    ``restart_s`` (their sum, unmeasured parts counted as 0) and ``not_measured`` (the names of those parts).
    """
    mine = [e for e in resumed if (tier_of(e) in MEMORY_RESUME_TIERS) == memory]
    parts: dict[str, float | None] = {}
    for part in RESTART_PARTS:
        values = []
        for e in mine:
            value = num(e.get(part), math.nan)
            if not math.isfinite(value):
                record = restarts.get(int(e.get("attempt", 0) or 0), {})
                value = num(record.get(_RESTART_RECORD_PARTS.get(part, part)), math.nan)
            if math.isfinite(value):
                values.append(value)
        parts[part] = statistics.median(values) if values else None
    return {
        "resumes": len(mine),
        "parts": parts,
        "restart_s": sum(v for v in parts.values() if v is not None),
        "not_measured": [p for p, v in parts.items() if v is None],
    }


def _tier_waste(cost_s: float, mttf_s: float, share: float) -> tuple[float | None, float, float]:
    """A tier's Young-Daly interval for the share of failures it recovers, and its save and lost-work waste there."""
    if share <= 0:
        return None, 0.0, 0.0
    interval_s = math.sqrt(2.0 * cost_s * mttf_s / share)
    save = cost_s / interval_s if interval_s > 0 else 0.0
    return interval_s, save, share * interval_s / (2.0 * mttf_s)


def _scenario(mttf_s: float, tiers: Sequence[tuple[str, float, float, float]]) -> dict[str, Any]:
    """``tiers``: (name, stall C, restart R, share of failures) for each tier in use."""
    intervals: dict[str, float | None] = {}
    save = lost = restart = 0.0
    for name, cost_s, restart_s, share in tiers:
        intervals[name], s, lo = _tier_waste(cost_s, mttf_s, share)
        save, lost, restart = save + s, lost + lo, restart + share * restart_s / mttf_s
    waste = save + lost + restart
    return {
        "ettr": max(1.0 - waste, 0.0),
        "waste": {"save": save, "lost": lost, "restart": restart},
        "interval_s": intervals,
    }


def project(
    *,
    gpus: Sequence[int],
    mttf_points: Mapping[int, float],
    mttf_source: str,
    durable_fraction: float,
    durable_fraction_source: str,
    durable: dict[str, Any],
    memory: dict[str, Any] | None,
    memory_note: str | None,
) -> dict[str, Any]:
    """The projected ETTR at each of ``gpus``, without and (where ``memory`` is given) with the memory tier.

    Args:
        gpus: the GPU counts to project to.
        mttf_points: GPU count -> mean time to failure in hours.
        mttf_source: where ``mttf_points`` come from (printed beside them).
        durable_fraction: the share of failures that need the durable tier when a memory tier is in use, in [0, 1].
        durable_fraction_source: where it comes from.
        durable: the durable tier's costs here: ``stall_s`` (``None``: no periodic save recorded, nothing is
            projected) and ``restart_s``, with ``parts`` and ``not_measured`` as :func:`restart_cost` gives them.
        memory: the memory tier's costs, the same keys, or ``None`` (the "with" column is omitted).
        memory_note: what was assumed for the memory tier, or why it is omitted (``None``: nothing to say).

    Returns ``gpus``, the inputs (``mttf_points_hours``, ``mttf_source``, ``durable_fraction`` and its source, the
    costs of each tier), ``memory_note``, ``note`` (why nothing is projected, else ``None``) and ``rows``: per GPU
    count ``mttf_s``, ``mttf_how``, ``without`` and ``with`` (``None`` without memory costs), each with ``ettr``,
    ``waste`` (``save``, ``lost``, ``restart`` as fractions of time) and ``interval_s`` per tier.
    """
    out: dict[str, Any] = {
        "gpus": list(gpus),
        "mttf_points_hours": {str(n): h for n, h in sorted(mttf_points.items())},
        "mttf_source": mttf_source,
        "durable_fraction": durable_fraction,
        "durable_fraction_source": durable_fraction_source,
        "durable": durable,
        "memory": memory,
        "memory_note": memory_note,
        "note": None,
        "rows": [],
    }
    if durable.get("stall_s") is None:
        out["note"] = "no periodic durable checkpoint recorded: no save cost to project from"
        return out
    for n in gpus:
        hours, how = mttf_hours(n, mttf_points)
        mttf_s = hours * 3600.0
        row: dict[str, Any] = {
            "gpus": n,
            "mttf_s": mttf_s,
            "mttf_how": how,
            "without": _scenario(mttf_s, [("durable", durable["stall_s"], durable["restart_s"], 1.0)]),
            "with": None,
        }
        if memory is not None:
            row["with"] = _scenario(
                mttf_s,
                [
                    ("memory", memory["stall_s"], memory["restart_s"], 1.0 - durable_fraction),
                    ("durable", durable["stall_s"], durable["restart_s"], durable_fraction),
                ],
            )
        out["rows"].append(row)
    return out
