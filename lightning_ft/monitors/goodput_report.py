"""Goodput of a run from its event log: where the wall time of every attempt went, as numbers and as a timeline.

Pure functions over the events of :func:`~lightning_ft.events.read_events` (docs/strategy.md, "Event log"); how attempts end
and link up is decided in :mod:`~lightning_ft.monitors.run_history`. :class:`~lightning_ft.monitors.goodput_monitor.
GoodputMonitor` uses :func:`summarize` live; ``lightning-ft report LOGDIR`` prints
:func:`~lightning_ft.monitors.goodput_text.format_report` of it and can draw :func:`plot_timeline`. The per-tier part
is :mod:`~lightning_ft.monitors.checkpoint_tiers`'s, the projection :mod:`~lightning_ft.monitors.goodput_projection`'s.

Definitions (all wall-clock seconds):

- an attempt runs from its process start (``attempt_start.process_start_time``, else the ``attempt_start`` time) to
  its last event; the run's wall time is the sum of its attempts plus the gaps before restarts (the gap before a
  continuation, a finished run launched again, is not the run's time);
- productive time is the step time of the ``progress`` events, plus, for steps an attempt trained after its last
  ``progress`` line (a kill, a hang), those steps times its step time (see :mod:`~lightning_ft.monitors.run_history`);
  *useful* productive time leaves out the steps that a later attempt computed again (lost work);
- start-up is the time from process start to the first step of the first attempt and of each continuation (a
  restart's is part of its restart time); the text report says so when it is more than half of the wall time;
- a restart's time runs from the fault to the next attempt's ``first_step``, split into detection, exit, relaunch,
  load and first step; recovery is the part from the next attempt's process start to that first step;
- lost steps are the steps a stopped attempt reached beyond the checkpoint the next one resumed from
  (``resumed.step``, 0 without a ``resumed`` event); lost time is the productive time spent on them, prorated within
  ``progress`` intervals;
- in the replica mode a lost group restarts nothing: the survivors' stall (``replica_lost.stall_s``, once per lost
  group) is reported; its wait for the next quorum is wall time outside the productive time, and the steps it
  discarded are lost time (their share of the attempt's productive time); a heal (``healed.seconds``) is the joining
  group's recovery, and an attempt that healed before its first step starts at the live step, recomputing nothing
  (:mod:`~lightning_ft.monitors.replica_goodput`);
- effective training time ratio (ETTR) = useful productive time / the run's wall time (never below 0);
- device utilisation = useful productive device-seconds / device-seconds held over the run's wall time (seconds times
  the world size of the attempt, or of the attempt being relaunched during a gap);
- the suggested checkpoint interval is Young and Daly's ``sqrt(2 * C * MTBF)``, per save tier: ``C`` the median
  time a periodic checkpoint of the tier blocked the loop (``stall_s``), ``MTBF`` the run's wall time over its
  failures (restarts that lost work or could have, see :mod:`~lightning_ft.monitors.run_history`, and a last attempt
  that hung or crashed), or an assumed one where none was observed, over the share of failures the tier recovers (all
  of them without a memory tier; see :mod:`~lightning_ft.monitors.checkpoint_tiers`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_ft.events import INCIDENT_EVENTS
from lightning_ft.monitors.checkpoint_tiers import (
    DEFAULT_DURABLE_FRACTION,
    DURABLE_FRACTION_SOURCE,
    tier_interval,
    tier_of,
    tier_summary,
)
from lightning_ft.monitors.goodput_projection import DEFAULT_MTTF_HOURS_AT, MTTF_SOURCE, project, restart_cost
from lightning_ft.monitors.goodput_text import fmt_ratio
from lightning_ft.monitors.replica_goodput import discarded_seconds, replica_summary
from lightning_ft.monitors.run_history import attempts as attempt_records
from lightning_ft.monitors.run_history import latest_run, link, num

_MERGED_BY = {
    # They stop the attempt; each rank may write its own record.
    "preempted": (),
    "hang": (),
    # One node leaves or refuses to join: once per node, however many of its ranks wrote it.
    "node_evicted": ("host",),
    "join_refused": ("host", "until"),
    "checkpoint_failed": ("tier", "step"),
    # Every rank of every surviving group may record a lost group.
    "replica_lost": ("replica_id", "step"),
}
"""Incidents that several ranks may record: one per attempt and these fields, at the earliest record."""
_NOT_AN_ATTEMPT = frozenset({"join_refused"})
"""Events of a process that refused to start: not part of any attempt's training."""
DEFAULT_MTBF_HOURS = 24.0
"""The MTBF the checkpoint-interval suggestion assumes when a run observed no failure and none is given."""


def summarize(
    events: Iterable[dict[str, Any]],
    *,
    mtbf_hours: float | None = None,
    durable_fraction: float | None = None,
    project_gpus: Sequence[int] | None = None,
    mttf_hours_at: Mapping[int, float] | None = None,
) -> dict[str, Any]:
    """Goodput summary of one run (the run of the last event, if the log holds several).

    Returns a JSON-able dict: ``attempts`` (one dict per attempt, with ``end_reason``), ``restarts`` (one per attempt
    that followed one that did not finish, with its phases), ``continuations`` (one per attempt that followed a
    finished one), ``totals``, ``ettr``, ``device_utilisation``, ``tiers`` (per checkpoint tier: saves, failed
    saves, restores, lost steps per failure, rejections; see
    :func:`~lightning_ft.monitors.checkpoint_tiers.tier_summary`), ``checkpoint_intervals`` (Young-Daly per save
    tier, ``memory`` ``None`` when the run used no memory tier), ``checkpoint_interval`` (the durable tier's, as in
    0.2.0), ``projection`` (``None`` unless ``project_gpus`` is given), ``stragglers``, ``incidents`` and
    ``replicas`` (:func:`~lightning_ft.monitors.replica_goodput.replica_summary`, ``None`` outside the replica
    mode). Ratios are
    ``None`` when the log holds no wall time.

    Args:
        events: the run's events, e.g. ``read_events(LOGDIR)``.
        mtbf_hours: the mean time between failures the checkpoint-interval suggestion uses in place of the observed
            one; also used, with :data:`DEFAULT_MTBF_HOURS` as the default, when the run observed no failure.
        durable_fraction: the share of failures, in [0, 1], that need the durable tier when a memory tier is in use
            (default :data:`~lightning_ft.monitors.checkpoint_tiers.DEFAULT_DURABLE_FRACTION`, an assumption); it
            sets each tier's interval and the projection "with the memory tier".
        project_gpus: GPU counts (positive integers) to project the ETTR to
            (:func:`~lightning_ft.monitors.goodput_projection.project`).
        mttf_hours_at: GPU count -> mean time to failure in hours, for the projection (default
            :data:`~lightning_ft.monitors.goodput_projection.DEFAULT_MTTF_HOURS_AT`).

    Raises:
        ValueError: ``mtbf_hours`` is not a positive number, ``durable_fraction`` not in [0, 1], ``project_gpus``
            not a non-empty list of positive integers, or ``mttf_hours_at`` not a non-empty mapping of positive
            integers to positive, finite hours.
    """
    if mtbf_hours is not None and not (isinstance(mtbf_hours, (int, float)) and mtbf_hours > 0):
        raise ValueError(f"summarize(mtbf_hours={mtbf_hours!r}): must be a positive number of hours")
    _check_projection_options(durable_fraction, project_gpus, mttf_hours_at)
    events = list(events)
    run_id, by_attempt = latest_run([e for e in events if e.get("event") not in _NOT_AN_ATTEMPT])
    refusals = [e for e in events if e.get("event") in _NOT_AN_ATTEMPT and e.get("run_id") == run_id]
    run_events = [e for evs in by_attempt.values() for e in evs]
    attempts = attempt_records(by_attempt)
    restarts: list[dict[str, Any]] = []
    continuations: list[dict[str, Any]] = []
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        linked = link(prev, cur)
        (restarts if "cause" in linked else continuations).append(linked)

    by_number = {a["attempt"]: a for a in attempts}
    replicas = replica_summary(run_events)
    # A replica group's failure restarts nothing: the survivors wait for the next quorum (wall time outside the
    # productive time) and the steps that saw it are discarded (productive time lost).
    stalls = replicas["lost"] if replicas is not None else []
    replica_stall_s = sum(num(r["stall_s"]) for r in stalls)
    discarded = _replica_discarded_s(stalls, attempts)
    wall_s = sum(a["wall_s"] for a in attempts) + sum(r["gap_s"] for r in restarts)
    productive_s = sum(a["productive_s"] for a in attempts)
    lost_s = sum(a["lost_s"] for a in attempts) + sum(discarded.values())
    useful_device_s = sum(
        max(a["productive_s"] - a["lost_s"] - discarded.get(a["attempt"], 0.0), 0.0) * a["world_size"] for a in attempts
    )
    held_device_s = sum(a["wall_s"] * a["world_size"] for a in attempts) + sum(
        r["gap_s"] * by_number[r["attempt"]]["world_size"] for r in restarts
    )
    # A last attempt that hung or crashed is a failure observed too, though nothing restarted it (yet).
    failures = sum(1 for r in restarts if r["failure"]) + sum(
        1 for a in attempts[-1:] if a["end_reason"] in ("hung", "crashed")
    )
    totals = {
        "attempts": len(attempts),
        "restarts": len(restarts),
        "continuations": len(continuations),
        "failures": failures,
        "wall_s": wall_s,
        "span_s": (attempts[-1]["end_time"] - attempts[0]["start_time"]) if attempts else 0.0,
        "productive_s": productive_s,
        "useful_productive_s": max(productive_s - lost_s, 0.0),
        "data_wait_s": sum(a["data_wait_s"] for a in attempts),
        "checkpoint_stall_s": sum(a["checkpoint_stall_s"] for a in attempts),
        "startup_s": _startup_s(attempts, restarts),
        "restart_s": sum(r["restart_s"] or 0.0 for r in restarts),
        "recovery_s": sum(r["recovery_s"] or 0.0 for r in restarts),
        "lost_steps": sum(a["lost_steps"] for a in attempts),
        "lost_s": lost_s,
        "straggler_s": sum(num(e.get("lost_s")) for e in run_events if e.get("event") == "straggler_cleared"),
        "device_s_held": held_device_s,
        "replica_stall_s": replica_stall_s,
        "replica_discarded_s": sum(discarded.values()),
        "heal_s": replicas["heal_s"] if replicas is not None else 0.0,
        "replicas_lost": replicas["replicas_lost"] if replicas is not None else 0,
        "replicas_joined": replicas["replicas_joined"] if replicas is not None else 0,
        "discarded_steps": replicas["discarded_steps"] if replicas is not None else 0,
        # Lighthouse outages: a quorum's wait, which the progress records count as data wait (not productive time).
        "lighthouse_outages": len(replicas["lighthouse_outages"]) if replicas is not None else 0,
        "lighthouse_stall_s": replicas["lighthouse_stall_s"] if replicas is not None else 0.0,
    }
    incidents = _incidents(sorted(run_events + refusals, key=lambda e: (num(e.get("time")), num(e.get("rank")))))
    tiers = tier_summary(run_events, restarts, attempts)
    fraction = DEFAULT_DURABLE_FRACTION if durable_fraction is None else float(durable_fraction)
    tiers["durable_fraction"] = fraction
    tiers["durable_fraction_source"] = "assumed" if durable_fraction is None else "given"
    tiers["observed_durable_fraction"] = _observed_durable_fraction(restarts) if tiers["memory_in_use"] else None
    intervals = _young_daly(run_events, attempts, wall_s, failures, mtbf_hours, tiers["memory_in_use"], fraction)
    for a in attempts:
        for key in [k for k in a if k.startswith("_")]:  # the history's working fields
            del a[key]
    summary = {
        "run_id": run_id,
        "attempts": attempts,
        "restarts": restarts,
        "continuations": continuations,
        "totals": totals,
        "ettr": max(productive_s - lost_s, 0.0) / wall_s if wall_s > 0 else None,
        "device_utilisation": useful_device_s / held_device_s if held_device_s > 0 else None,
        "tiers": tiers,
        "checkpoint_intervals": intervals,
        "checkpoint_interval": intervals["durable"],
        "projection": None,
        "stragglers": _stragglers(run_events, totals["straggler_s"]),
        "incidents": incidents,
        "replicas": replicas,
    }
    if project_gpus is not None:
        summary["projection"] = _projection(
            summary,
            run_events,
            gpus=list(project_gpus),
            mttf_points=dict(DEFAULT_MTTF_HOURS_AT if mttf_hours_at is None else mttf_hours_at),
            mttf_given=mttf_hours_at is not None,
            fraction=fraction,
            fraction_given=durable_fraction is not None,
        )
    return summary


def _startup_s(attempts: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> float:
    """Seconds from process start to the first step of the attempts that are no restart (the first, continuations):
    imports, process group, model set-up. A restart's own start-up is part of its restart time."""
    restarted = {r["attempt"] for r in restarts}
    total = 0.0
    for a in attempts:
        if a["attempt"] in restarted:
            continue
        first = a["first_step_time"] if a["first_step_time"] is not None else a["end_time"]
        total += max(first - a["start_time"], 0.0)
    return total


def _check_projection_options(durable_fraction: Any, project_gpus: Any, mttf_hours_at: Any) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if durable_fraction is not None and not (number(durable_fraction) and 0 <= durable_fraction <= 1):
        raise ValueError(f"summarize(durable_fraction={durable_fraction!r}): must be a number from 0 to 1")
    if project_gpus is not None and not (
        isinstance(project_gpus, Sequence)
        and project_gpus
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in project_gpus)
    ):
        raise ValueError(f"summarize(project_gpus={project_gpus!r}): must be a non-empty list of positive integers")
    if mttf_hours_at is not None and not (
        isinstance(mttf_hours_at, Mapping)
        and mttf_hours_at
        and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 and number(h) and h > 0
            for n, h in mttf_hours_at.items()
        )
    ):
        raise ValueError(
            f"summarize(mttf_hours_at={mttf_hours_at!r}): must map positive GPU counts to positive, finite hours"
        )


def _replica_discarded_s(lost: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> dict[int, float]:
    """Per attempt, the productive seconds of the steps its group discarded when groups were lost (each step once,
    however many groups its loss names)."""
    by_attempt: dict[int, dict[Any, int]] = {}
    for r in lost:
        steps = by_attempt.setdefault(int(num(r.get("attempt"))), {})
        steps[r.get("step")] = max(steps.get(r.get("step"), 0), int(num(r.get("discarded_steps"))))
    out = {}
    for a in attempts:
        discarded = sum(by_attempt.get(a["attempt"], {}).values())
        if discarded:
            committed = max((a["last_step"] or a["start_step"]) - a["start_step"], 0)
            out[a["attempt"]] = discarded_seconds(discarded, a["productive_s"], committed)
    return out


def _observed_durable_fraction(restarts: list[dict[str, Any]]) -> dict[str, int] | None:
    """Of this run's failures, how many resumed from the durable tier (or from nothing) and how many from memory."""
    failed = [r for r in restarts if r["failure"]]
    if not failed:
        return None
    durable = sum(1 for r in failed if r.get("resumed_tier") in (None, "durable"))
    return {"durable": durable, "failures": len(failed)}


def _projection(
    summary: dict[str, Any],
    run_events: list[dict[str, Any]],
    *,
    gpus: list[int],
    mttf_points: dict[int, float],
    mttf_given: bool,
    fraction: float,
    fraction_given: bool,
) -> dict[str, Any]:
    resumed = [e for e in run_events if e.get("event") == "resumed" and e.get("rank", 0) == 0]
    restarts = {r["attempt"]: r for r in summary["restarts"]}
    intervals = summary["checkpoint_intervals"]
    durable = {"stall_s": intervals["durable"]["stall_s"], **restart_cost(resumed, restarts, memory=False)}
    memory: dict[str, Any] | None = None
    memory_stall = intervals["memory"]["stall_s"] if intervals["memory"] is not None else None
    if memory_stall is None:
        note = (
            'omitted: this run recorded no memory-tier save (checkpoint_committed with tier "memory" and a stall_s),'
            " so there is no memory save cost to project from"
        )
    else:
        memory = {"stall_s": memory_stall, **restart_cost(resumed, restarts, memory=True)}
        note = None
        if memory["resumes"] == 0:
            memory.update({k: durable[k] for k in ("parts", "restart_s", "not_measured")})
            memory["restart_assumed"] = True
            note = (
                "a restart from the memory tier is assumed to cost what one from the durable tier did (this run"
                " recorded no resume from the memory tier): only the save cost and the lost work differ"
            )
    return project(
        gpus=gpus,
        mttf_points=mttf_points,
        mttf_source="given (--mttf-hours-at)" if mttf_given else MTTF_SOURCE,
        durable_fraction=fraction,
        durable_fraction_source="given (--durable-fraction)" if fraction_given else DURABLE_FRACTION_SOURCE,
        durable=durable,
        memory=memory,
        memory_note=note,
    )


def _incidents(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per incident. A preemption or a hang stops the whole attempt and every rank may record it: those
    of one attempt are one incident, at the earliest record, with ``ranks_recorded``."""
    out: list[dict[str, Any]] = []
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        name = e.get("event")
        if name not in INCIDENT_EVENTS or (name == "thermal" and not e.get("reasons")):
            continue
        incident = {k: e.get(k) for k in ("time", "attempt", "rank", "event", "step")} | _incident_detail(e)
        if name not in _MERGED_BY:
            out.append(incident)
            continue
        key = (e.get("attempt"), name, *(str(e.get(k)) for k in _MERGED_BY[name]))
        first = merged.get(key)
        if first is None:
            merged[key] = first = incident | {"ranks_recorded": [e.get("rank")]}
            out.append(first)
        elif e.get("rank") not in first["ranks_recorded"]:
            first["ranks_recorded"] = sorted([*first["ranks_recorded"], e.get("rank")], key=lambda r: num(r))
        if name == "join_refused":  # the event names no ranks: those of the node are the ones that refused
            first["ranks"] = first["ranks_recorded"]
    return out


def _stragglers(events: list[dict[str, Any]], lost_s: float) -> dict[str, Any]:
    detections = [
        {
            "step": e.get("step"),
            "suspect_rank": e.get("suspect_rank"),
            "ratio": e.get("ratio"),
            "onset_step": e.get("onset_step"),
            "latency_steps": e["step"] - e["onset_step"]
            if isinstance(e.get("step"), int) and isinstance(e.get("onset_step"), int)
            else None,
            "attempt": e.get("attempt"),
        }
        for e in events
        if e.get("event") == "straggler"
    ]
    return {"count": len(detections), "detections": detections, "lost_s": lost_s}


def _young_daly(
    events: list[dict[str, Any]],
    attempts: list[dict[str, Any]],
    wall_s: float,
    failures: int,
    mtbf_hours: float | None,
    memory_in_use: bool,
    durable_fraction: float,
) -> dict[str, dict[str, Any] | None]:
    """Young and Daly's interval per save tier; ``memory`` is ``None`` when the run used no memory tier."""
    observed_mtbf_s = wall_s / failures if failures else None
    if mtbf_hours is not None:
        mtbf_s, source = mtbf_hours * 3600.0, "given"
    elif observed_mtbf_s is not None:
        mtbf_s, source = observed_mtbf_s, "observed"
    else:
        mtbf_s, source = DEFAULT_MTBF_HOURS * 3600.0, "assumed"
    steps = sum(max((a["last_step"] or 0) - a["start_step"], 0) for a in attempts if a["productive_s"] > 0)
    busy_s = sum(a["productive_s"] + a["data_wait_s"] for a in attempts)
    step_s = busy_s / steps if steps and busy_s > 0 else None
    run = {
        "failures": failures,
        "observed_mtbf_s": observed_mtbf_s,
        "mtbf_s": mtbf_s,
        "mtbf_source": source,
        "step_s": step_s,
    }
    # Without a memory tier, the durable tier recovers every failure; with one, the share that needs it.
    shares = {"durable": durable_fraction, "memory": 1.0 - durable_fraction} if memory_in_use else {"durable": 1.0}
    out: dict[str, dict[str, Any] | None] = {"durable": None, "memory": None}
    for tier, share in shares.items():
        out[tier] = run | tier_interval(events, attempts, tier=tier, mtbf_s=mtbf_s, share=share, step_s=step_s)
    return out


def _incident_detail(e: dict[str, Any]) -> dict[str, Any]:
    keys = {
        "preempted": ("signal", "signal_time", "checkpoint_path", "exit_code"),
        "hang": ("idle_s", "ranks", "stacks_path"),
        "straggler": ("suspect_rank", "ratio", "onset_step"),
        "thermal": ("device", "reasons", "temperature_c", "sm_clock_mhz"),
        "checkpoint_rejected": ("tier", "path", "reason"),
        "checkpoint_failed": ("tier", "reason"),
        "node_evicted": ("host", "ranks", "source", "reason", "cooldown_s", "record_path"),
        "join_refused": ("host", "reason", "until", "exit_code"),
        "replica_lost": ("replica_id", "stall_s", "discarded_steps"),
        "replica_duplicate": ("replica_id", "others"),
        "replica_orphaned": ("replica_id", "parent_pid"),
        "lighthouse_outage": ("lighthouse", "down_s", "stall_s"),
        "lighthouse_lost": ("lighthouse", "waited_s", "checkpoint_path"),
    }[e["event"]]
    detail = {k: e.get(k) for k in keys}
    if "tier" in detail:
        detail["tier"] = tier_of(e)  # no tier: a log older than the tiers, where every checkpoint was durable
    return detail


_COLOURS = {
    "preempted": "tab:red",
    "hang": "tab:purple",
    "straggler": "tab:orange",
    "thermal": "tab:brown",
    "checkpoint_rejected": "tab:gray",
    "checkpoint_failed": "tab:olive",
    "node_evicted": "tab:pink",
    "join_refused": "tab:cyan",
    "replica_lost": "tab:blue",
    "replica_duplicate": "tab:gray",
    "replica_orphaned": "black",
    "lighthouse_outage": "tab:green",
    "lighthouse_lost": "darkred",
}


_END_MARKERS = {
    "finished": ("o", "tab:green"),
    "preempted": ("v", "tab:red"),
    "hung": ("s", "tab:purple"),
    "crashed": ("X", "tab:red"),
    "stopped": ("D", "tab:orange"),
    "killed": ("X", "black"),
    "unknown": ("P", "tab:gray"),
}
"""Marker and colour of each way an attempt can end (run_history's recorded and inferred ends)."""
_END_LABELS = {
    "killed": "killed (no end recorded)",
    "unknown": "no end recorded",
}


def plot_timeline(events: Iterable[dict[str, Any]], out_png: str | os.PathLike[str]) -> None:
    """Draw the run as a PNG (:func:`timeline_figure`).

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install 'lightning-ft[plot]'``).
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(events)
    fig.savefig(os.fspath(out_png), dpi=100)
    plt.close(fig)


def timeline_figure(events: Iterable[dict[str, Any]]) -> Any:
    """The run as a matplotlib figure: global step over time per attempt, a marker where each attempt ended (one
    per kind of end: finished, preempted, hung, crashed, stopped, killed, no end recorded), the committed
    checkpoints, the incidents, and below, each attempt's time: start-up (the first attempt's and a continuation's
    process start to first step), recovery (a restarted attempt's), training, the time from the fault to the
    attempt's last record, and the time between attempts before a restart. A kill and a hang are marked where the
    attempt was last seen training; the other ends at the attempt's last record. The caller closes it
    (``matplotlib.pyplot.close(fig)``).

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install 'lightning-ft[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ModuleNotFoundError(
            "plot_timeline needs matplotlib; install it with `pip install 'lightning-ft[plot]'`"
        ) from err
    events = list(events)
    summary = summarize(events)
    t0 = min((a["start_time"] for a in summary["attempts"]), default=0.0)
    fig, (ax, bars) = plt.subplots(
        2, 1, figsize=(11, 5.5), sharex=True, gridspec_kw={"height_ratios": [4, 1]}, constrained_layout=True
    )
    run = [e for e in events if e.get("run_id") == summary["run_id"] and e.get("rank", 0) == 0]
    restarted = {r["attempt"] for r in summary["restarts"]}
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        """``label`` the first time (one legend entry per kind), else ``None``."""
        if label in labelled:
            return None
        labelled.add(label)
        return label

    previous_end: float | None = None
    for a in summary["attempts"]:
        pts = [  # a line written after its step (at a failure, a hang) is drawn when its step ended
            (num(e.get("last_step_time"), num(e["time"])) - t0, e["step"])
            for e in run
            if e.get("attempt") == a["attempt"] and e.get("event") in ("progress", "first_step")
            if isinstance(e.get("step"), int)
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=f"attempt {a['attempt']}")
        start, end = a["start_time"] - t0, a["end_time"] - t0
        first = a["first_step_time"] - t0 if a["first_step_time"] is not None else end
        if a["attempt"] in restarted:
            if previous_end is not None and start > previous_end:
                bars.broken_barh(
                    [(previous_end, start - previous_end)],
                    (0, 1),
                    color="tab:red",
                    alpha=0.15,
                    label=once("between attempts (relaunch)"),
                )
            bars.broken_barh([(start, first - start)], (0, 1), color="tab:gray", alpha=0.5, label=once("recovery"))
        else:
            bars.broken_barh([(start, first - start)], (0, 1), color="tab:blue", alpha=0.35, label=once("start-up"))
        # Training up to the fault (a kill: the last record of its last step; a hang: its last progress), then the
        # time the attempt took to notice and stop.
        reason = a["end_reason"]
        fault = a["fault_time"] - t0 if a["fault_time"] is not None and reason != "finished" else end
        fault = min(max(fault, first), end)
        bars.broken_barh([(first, fault - first)], (0, 1), color="tab:green", alpha=0.6, label=once("training"))
        if end > fault:
            bars.broken_barh(
                [(fault, end - fault)], (0, 1), color="tab:orange", alpha=0.5, label=once("fault to end (detection)")
            )
        previous_end = end
        marker, colour = _END_MARKERS.get(reason, _END_MARKERS["unknown"])
        at = fault + t0 if reason in ("killed", "unknown", "hung") else a["end_time"]
        step = a["last_step"] if a["last_step"] is not None else a["start_step"]
        ax.scatter(
            [at - t0],
            [step],
            marker=marker,
            s=90,
            color=colour,
            edgecolors="black",
            linewidths=0.5,
            zorder=5,
            label=once(f"ended: {_END_LABELS.get(reason, reason)}"),
        )
    for e in run:
        if e.get("event") == "checkpoint_committed":
            memory = tier_of(e) == "memory"
            ax.axvline(
                num(e["time"]) - t0,
                color="tab:green",
                alpha=0.2 if memory else 0.35,
                linewidth=1,
                linestyle=":" if memory else "-",
                label=once("memory-tier checkpoint" if memory else "checkpoint committed"),
            )
    for i in summary["incidents"]:
        name = i["event"]
        ax.axvline(num(i["time"]) - t0, color=_COLOURS[name], linestyle="--", label=once(name))
    ax.set_ylabel("global step")
    ax.set_title(
        f"run {summary['run_id']}: ETTR {fmt_ratio(summary['ettr'])}, "
        f"{summary['totals']['restarts']} restart(s), {summary['stragglers']['count']} straggler detection(s)"
    )
    ax.legend(loc="upper left", fontsize="small", ncol=2)
    bars.set_yticks([])
    bars.set_ylim(0, 2.0)
    bars.legend(loc="upper left", fontsize="x-small", ncol=6)
    bars.set_xlabel("seconds since the first process start")
    return fig
