"""Checkpoint tiers in a run's event log: what each tier saved, restored, lost and rejected, and the Young-Daly
interval of each tier.

Pure functions over the events of one run (:func:`~lightning_ft.monitors.run_history.latest_run`) and the attempt and
restart records of :mod:`~lightning_ft.monitors.run_history`; :func:`~lightning_ft.monitors.goodput_report.summarize`
puts their results under ``tiers`` and ``checkpoint_intervals``. The rules, in one place:

- A save belongs to the tier its ``checkpoint_committed.tier`` names: ``"durable"`` (the checkpoint folder, driven by
  ``ModelCheckpoint``) or ``"memory"`` (node-local memory with a peer copy). A line without ``tier`` (lightning-ft
  0.2.0 and older) is durable, so an older log reads as it always did. The same holds for ``checkpoint_rejected``
  (``"durable"``, ``"local"``, ``"peer"``) and ``resumed`` (``"durable"``, ``"local"``: every rank restored from its
  own node's copy, ``"peer"``: at least one rank restored from a partner's copy); ``checkpoint_failed`` names the tier
  of a save that failed without failing the run.
- Saves and resumes are rank 0's lines; a failed save or a rejection that several ranks recorded counts once (per
  attempt, tier and step, or path).
- The lost steps of a tier are those of each *failure* (a restart that recomputed steps or could have, see
  :func:`~lightning_ft.monitors.run_history.link`) whose next attempt resumed from that tier; a restart without a
  ``resumed`` event (nothing to resume from) is listed under ``"none"``.
- Young and Daly's interval of a tier is ``sqrt(2 * C * MTBF_tier)``: ``C`` the median time a periodic save of that
  tier blocked the loop (``stall_s``; preemption and straggler-stop saves are taken on demand, not on the interval,
  and are left out), ``MTBF_tier`` the run's mean time between failures over the share of failures that tier recovers.
  Without a memory tier that share is 1 and the interval is the one lightning-ft 0.2.0 printed. With one, a share
  ``f`` of failures (``durable_fraction``) needs the durable tier (the memory copies are gone: a node lost together
  with its partner, a job placed on other nodes, a memory copy that fails validation) and ``1 - f`` are recovered
  from memory. Each share sets its tier's optimum because the expected waste is
  ``C_m / tau_m + C_d / tau_d + ((1 - f) * (tau_m / 2 + R_m) + f * (tau_d / 2 + R_d)) / MTBF``
  (docs/fault-tolerance.md, "Choosing the checkpoint interval"), smallest at
  ``tau_m = sqrt(2 * C_m * MTBF / (1 - f))`` and ``tau_d = sqrt(2 * C_d * MTBF / f)``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from lightning_ft.monitors.run_history import num

SAVE_TIERS = ("durable", "memory")
"""The tiers a ``checkpoint_committed`` or ``checkpoint_failed`` line names."""
RESUME_TIERS = ("local", "peer", "durable")
"""The tiers a ``resumed`` line names; ``local`` and ``peer`` are the memory tier's two copies."""
MEMORY_RESUME_TIERS = frozenset({"local", "peer"})
REJECT_TIERS = ("durable", "local", "peer")
"""The tiers a ``checkpoint_rejected`` line names."""
DEFAULT_DURABLE_FRACTION = 53 / 419
"""The share of failures assumed to need the durable tier when a memory tier is in use and none is given (12.6%): an
assumption taken from :data:`DURABLE_FRACTION_SOURCE`. It counts every failure that loses a node's host memory as one
the memory tier cannot survive, which holds for the local copy alone; a peer copy survives most of them (only a node
lost together with its partner needs the durable tier), so with peer copies it is a cautious figure."""
DURABLE_FRACTION_SOURCE = (
    "the share of Llama 3 405B's 419 unplanned interruptions that lost a host's memory: 21 host faults and 32 unplanned"
    " host maintenances (Llama 3 paper, arXiv 2407.21783, table 5)"
)


def tier_of(event: dict[str, Any], default: str = "durable") -> str:
    """The tier an event names; ``default`` (durable) when it names none (logs older than the memory tier)."""
    tier = event.get("tier")
    return tier if isinstance(tier, str) and tier else default


def is_periodic(commit: dict[str, Any]) -> bool:
    """Whether a ``checkpoint_committed`` line is a save on the interval (not a preemption or straggler-stop one)."""
    return "preempt-step=" not in str(commit.get("path", ""))


def _median(values: Iterable[Any]) -> float | None:
    finite = [v for v in (num(x, math.nan) for x in values) if math.isfinite(v)]
    return statistics.median(finite) if finite else None


def _once(events: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    """The first of the events that agree on ``attempt`` and ``keys``: a line several ranks recorded counts once."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for e in events:
        key = (e.get("attempt"), tier_of(e), *(str(e.get(k)) for k in keys))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def tier_summary(
    run_events: list[dict[str, Any]], restarts: list[dict[str, Any]], attempts: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per tier: saves, failed saves, restores, lost steps per failure and rejected checkpoints.

    Returns ``{"memory_in_use": bool, "saves": {tier: ...}, "restores": {tier: ...}, "rejected": {tier: n}}``:

    - ``saves[tier]`` (``durable`` and ``memory`` always, any other tier a log names too): ``count``, ``stall_s``,
      ``total_s``, ``size_bytes`` and ``peer_bytes`` (medians over the tier's committed saves, ``None`` without
      any), ``failed`` (failed saves) and ``failed_reasons`` (reason -> count);
    - ``restores[tier]`` (``local``, ``peer`` and ``durable`` always, ``none`` when a restart resumed from nothing):
      ``attempts`` (resumed from it), ``load_s`` (median), ``restored_from`` (ranks per tier, summed), ``failures``
      (failures resumed from it), ``lost_steps`` (one entry per such failure) and ``lost_steps_per_failure`` (their
      mean, ``None`` without any).
    """
    rank0 = [e for e in run_events if e.get("rank", 0) == 0]
    commits = [e for e in rank0 if e.get("event") == "checkpoint_committed"]
    failed = _once([e for e in run_events if e.get("event") == "checkpoint_failed"], "step")
    rejected = _once([e for e in run_events if e.get("event") == "checkpoint_rejected"], "path")
    resumed = [e for e in rank0 if e.get("event") == "resumed"]

    save_tiers = list(SAVE_TIERS) + sorted({tier_of(e) for e in commits + failed} - set(SAVE_TIERS))
    saves = {}
    for tier in save_tiers:
        mine = [e for e in commits if tier_of(e) == tier]
        failures_here = [e for e in failed if tier_of(e) == tier]
        saves[tier] = {
            "count": len(mine),
            "stall_s": _median(e.get("stall_s") for e in mine),
            "total_s": _median(e.get("total_s") for e in mine),
            "size_bytes": _median(e.get("size_bytes") for e in mine),
            "peer_bytes": _median(e.get("peer_bytes") for e in mine),
            "failed": len(failures_here),
            "failed_reasons": dict(Counter(str(e.get("reason")) for e in failures_here)),
        }

    resumed_tier = {a["attempt"]: a.get("resumed_tier") for a in attempts}
    failed_restarts = [r for r in restarts if r["failure"]]
    restore_tiers = list(RESUME_TIERS) + sorted(
        {tier_of(e) for e in resumed} - set(RESUME_TIERS)
        | ({"none"} if any(resumed_tier.get(r["attempt"]) is None for r in failed_restarts) else set())
    )
    restores = {}
    for tier in restore_tiers:
        mine = [e for e in resumed if tier_of(e) == tier]
        lost = [r["lost_steps"] for r in failed_restarts if (resumed_tier.get(r["attempt"]) or "none") == tier]
        ranks: Counter[str] = Counter()
        for e in mine:
            source = e.get("restored_from")
            if isinstance(source, dict):
                ranks.update({str(k): int(v) for k, v in source.items() if isinstance(v, int)})
        restores[tier] = {
            "attempts": len(mine),
            "load_s": _median(e.get("load_s") for e in mine),
            "restored_from": dict(ranks),
            "failures": len(lost),
            "lost_steps": lost,
            "lost_steps_per_failure": sum(lost) / len(lost) if lost else None,
        }

    reject_tiers = list(REJECT_TIERS) + sorted({tier_of(e) for e in rejected} - set(REJECT_TIERS))
    return {
        "memory_in_use": saves["memory"]["count"] > 0
        or saves["memory"]["failed"] > 0
        or any(restores[t]["attempts"] for t in MEMORY_RESUME_TIERS),
        "saves": saves,
        "restores": restores,
        "rejected": {tier: sum(1 for e in rejected if tier_of(e) == tier) for tier in reject_tiers},
    }


def tier_interval(
    run_events: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    *,
    tier: str,
    mtbf_s: float,
    share: float,
    step_s: float | None,
) -> dict[str, Any]:
    """Young and Daly's interval for one save tier, with the tier's current interval beside it.

    Args:
        run_events: the run's events (rank 0's ``checkpoint_committed`` lines are read).
        attempts: the attempt records (the current interval is measured within each attempt).
        tier: ``"durable"`` or ``"memory"``.
        mtbf_s: the run's mean time between failures (all failures).
        share: the share of failures this tier recovers, in [0, 1]: the tier's MTBF is ``mtbf_s / share`` (``None``,
            no interval, at 0).
        step_s: seconds per training step, to give the interval in steps (``None``: not in steps).

    Returns ``stall_s`` (the median stall of the tier's periodic saves, ``None`` without any), ``total_s``,
    ``failure_share``, ``tier_mtbf_s``, ``interval_s`` (``None`` without saves, with no stall, or at share 0),
    ``interval_steps``, ``current_interval_steps`` (median steps between consecutive periodic saves of one attempt)
    and ``current_interval_s`` (that times ``step_s``).
    """
    commits = [
        e
        for e in run_events
        if e.get("event") == "checkpoint_committed" and e.get("rank", 0) == 0 and tier_of(e) == tier and is_periodic(e)
    ]
    cost_s = _median(e.get("stall_s") for e in commits)
    tier_mtbf_s = mtbf_s / share if share > 0 else None
    interval_s = (
        math.sqrt(2.0 * cost_s * tier_mtbf_s) if cost_s is not None and cost_s > 0 and tier_mtbf_s is not None else None
    )
    periodic = {(e.get("attempt"), e.get("step")) for e in commits if isinstance(e.get("step"), int)}
    spacing = [b - a for at in attempts for a, b in pairwise(sorted({s for (n, s) in periodic if n == at["attempt"]}))]
    current = statistics.median(spacing) if spacing else None
    return {
        "tier": tier,
        "stall_s": cost_s,
        "total_s": _median(e.get("total_s") for e in commits),
        "failure_share": share,
        "tier_mtbf_s": tier_mtbf_s,
        "interval_s": interval_s,
        "interval_steps": max(round(interval_s / step_s), 1) if interval_s is not None and step_s else None,
        "current_interval_steps": current,
        "current_interval_s": current * step_s if current is not None and step_s else None,
    }
