"""Goodput of a run from its event log: where the wall time of every attempt went, as numbers and as a timeline.

Pure functions over the events of :func:`~lightning_ft.events.read_events` (docs/strategy.md, "Event log"); how attempts end
and link up is decided in :mod:`~lightning_ft.monitors.run_history`. :class:`~lightning_ft.monitors.goodput_monitor.
GoodputMonitor` uses :func:`summarize` live; ``lightning-ft report LOGDIR`` prints :func:`format_report` of it and can
draw :func:`plot_timeline`.

Definitions (all wall-clock seconds):

- an attempt runs from its process start (``attempt_start.process_start_time``, else the ``attempt_start`` time) to
  its last event; the run's wall time is the sum of its attempts plus the gaps before restarts (the gap before a
  continuation, a finished run launched again, is not the run's time);
- productive time is the step time of the ``progress`` events; *useful* productive time leaves out the steps that a
  later attempt computed again (lost work);
- a restart's time runs from the fault to the next attempt's ``first_step``, split into detection, exit, relaunch,
  load and first step; recovery is the part from the next attempt's process start to that first step;
- lost steps are the steps a stopped attempt reached beyond the checkpoint the next one resumed from
  (``resumed.step``, 0 without a ``resumed`` event); lost time is the productive time spent on them, prorated within
  ``progress`` intervals;
- effective training time ratio (ETTR) = useful productive time / the run's wall time;
- device utilisation = useful productive device-seconds / device-seconds held over the run's wall time (seconds times
  the world size of the attempt, or of the attempt being relaunched during a gap);
- the suggested checkpoint interval is Young and Daly's ``sqrt(2 * C * MTBF)``: ``C`` the median time a checkpoint
  blocked the loop (``stall_s``), ``MTBF`` the run's wall time over its failures (restarts that lost work or could
  have, see :mod:`~lightning_ft.monitors.run_history`, and a last attempt that hung or crashed), or an assumed one
  where none was observed.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from lightning_ft.monitors.run_history import attempts as attempt_records
from lightning_ft.monitors.run_history import latest_run, link, num

INCIDENT_EVENTS = ("preempted", "hang", "straggler", "thermal", "checkpoint_rejected")
_ONE_PER_ATTEMPT = frozenset({"preempted", "hang"})  # they stop the attempt; each rank may write its own record
DEFAULT_MTBF_HOURS = 24.0
"""The MTBF the checkpoint-interval suggestion assumes when a run observed no failure and none is given."""


def summarize(events: Iterable[dict[str, Any]], *, mtbf_hours: float | None = None) -> dict[str, Any]:
    """Goodput summary of one run (the run of the last event, if the log holds several).

    Returns a JSON-able dict: ``attempts`` (one dict per attempt, with ``end_reason``), ``restarts`` (one per attempt
    that followed one that did not finish, with its phases), ``continuations`` (one per attempt that followed a
    finished one), ``totals``, ``ettr``, ``device_utilisation``, ``checkpoint_interval`` (Young-Daly),
    ``stragglers`` and ``incidents``. Ratios are ``None`` when the log holds no wall time.

    Args:
        events: the run's events, e.g. ``read_events(LOGDIR)``.
        mtbf_hours: the mean time between failures the checkpoint-interval suggestion uses in place of the observed
            one; also used, with :data:`DEFAULT_MTBF_HOURS` as the default, when the run observed no failure.

    Raises:
        ValueError: ``mtbf_hours`` is not a positive number.
    """
    if mtbf_hours is not None and not (isinstance(mtbf_hours, (int, float)) and mtbf_hours > 0):
        raise ValueError(f"summarize(mtbf_hours={mtbf_hours!r}): must be a positive number of hours")
    events = list(events)
    run_id, by_attempt = latest_run(events)
    run_events = [e for evs in by_attempt.values() for e in evs]
    attempts = attempt_records(by_attempt)
    restarts: list[dict[str, Any]] = []
    continuations: list[dict[str, Any]] = []
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        linked = link(prev, cur)
        (restarts if "cause" in linked else continuations).append(linked)

    by_number = {a["attempt"]: a for a in attempts}
    wall_s = sum(a["wall_s"] for a in attempts) + sum(r["gap_s"] for r in restarts)
    productive_s = sum(a["productive_s"] for a in attempts)
    lost_s = sum(a["lost_s"] for a in attempts)
    useful_device_s = sum((a["productive_s"] - a["lost_s"]) * a["world_size"] for a in attempts)
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
        "useful_productive_s": productive_s - lost_s,
        "data_wait_s": sum(a["data_wait_s"] for a in attempts),
        "checkpoint_stall_s": sum(a["checkpoint_stall_s"] for a in attempts),
        "restart_s": sum(r["restart_s"] or 0.0 for r in restarts),
        "recovery_s": sum(r["recovery_s"] or 0.0 for r in restarts),
        "lost_steps": sum(a["lost_steps"] for a in attempts),
        "lost_s": lost_s,
        "straggler_s": sum(num(e.get("lost_s")) for e in run_events if e.get("event") == "straggler_cleared"),
        "device_s_held": held_device_s,
    }
    incidents = _incidents(run_events)
    for a in attempts:
        del a["_progress"]
    return {
        "run_id": run_id,
        "attempts": attempts,
        "restarts": restarts,
        "continuations": continuations,
        "totals": totals,
        "ettr": (productive_s - lost_s) / wall_s if wall_s > 0 else None,
        "device_utilisation": useful_device_s / held_device_s if held_device_s > 0 else None,
        "checkpoint_interval": _young_daly(run_events, attempts, wall_s, failures, mtbf_hours),
        "stragglers": _stragglers(run_events, totals["straggler_s"]),
        "incidents": incidents,
    }


def _incidents(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per incident. A preemption or a hang stops the whole attempt and every rank may record it: those
    of one attempt are one incident, at the earliest record, with ``ranks_recorded``."""
    out: list[dict[str, Any]] = []
    merged: dict[tuple[Any, str], dict[str, Any]] = {}
    for e in events:
        name = e.get("event")
        if name not in INCIDENT_EVENTS or (name == "thermal" and not e.get("reasons")):
            continue
        incident = {k: e.get(k) for k in ("time", "attempt", "rank", "event", "step")} | _incident_detail(e)
        if name not in _ONE_PER_ATTEMPT:
            out.append(incident)
            continue
        first = merged.get((e.get("attempt"), name))
        if first is None:
            merged[(e.get("attempt"), name)] = incident | {"ranks_recorded": [e.get("rank")]}
            out.append(merged[(e.get("attempt"), name)])
        elif e.get("rank") not in first["ranks_recorded"]:
            first["ranks_recorded"] = sorted([*first["ranks_recorded"], e.get("rank")], key=lambda r: num(r))
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
) -> dict[str, Any]:
    # Periodic checkpoints only: a preemption or straggler-stop checkpoint is taken on demand, not on the interval.
    commits = [
        e
        for e in events
        if e.get("event") == "checkpoint_committed"
        and e.get("rank", 0) == 0
        and "preempt-step=" not in str(e.get("path", ""))
    ]
    stalls = [num(e.get("stall_s"), math.nan) for e in commits]
    stalls = [s for s in stalls if math.isfinite(s)]
    totals = [t for t in (num(e.get("total_s"), math.nan) for e in commits) if math.isfinite(t)]
    observed_mtbf_s = wall_s / failures if failures else None
    if mtbf_hours is not None:
        mtbf_s, source = mtbf_hours * 3600.0, "given"
    elif observed_mtbf_s is not None:
        mtbf_s, source = observed_mtbf_s, "observed"
    else:
        mtbf_s, source = DEFAULT_MTBF_HOURS * 3600.0, "assumed"
    cost_s = statistics.median(stalls) if stalls else None
    interval_s = math.sqrt(2.0 * cost_s * mtbf_s) if cost_s is not None and cost_s > 0 else None
    steps = sum(max((a["last_step"] or 0) - a["start_step"], 0) for a in attempts if a["productive_s"] > 0)
    busy_s = sum(a["productive_s"] + a["data_wait_s"] for a in attempts)
    step_s = busy_s / steps if steps and busy_s > 0 else None
    periodic = {(e.get("attempt"), e.get("step")) for e in commits}
    spacing = [
        b - a
        for at in attempts
        for a, b in pairwise(s for s in at["checkpoint_steps"] if (at["attempt"], s) in periodic)
    ]
    return {
        "stall_s": cost_s,
        "total_s": statistics.median(totals) if totals else None,
        "failures": failures,
        "observed_mtbf_s": observed_mtbf_s,
        "mtbf_s": mtbf_s,
        "mtbf_source": source,
        "interval_s": interval_s,
        "interval_steps": max(round(interval_s / step_s), 1) if interval_s is not None and step_s else None,
        "current_interval_steps": statistics.median(spacing) if spacing else None,
        "step_s": step_s,
    }


def _incident_detail(e: dict[str, Any]) -> dict[str, Any]:
    keys = {
        "preempted": ("signal", "signal_time", "checkpoint_path", "exit_code"),
        "hang": ("idle_s", "ranks", "stacks_path"),
        "straggler": ("suspect_rank", "ratio", "onset_step"),
        "thermal": ("device", "reasons", "temperature_c", "sm_clock_mhz"),
        "checkpoint_rejected": ("path", "reason"),
    }[e["event"]]
    return {k: e.get(k) for k in keys}


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 3600:
        return f"{value / 3600:.1f}h"
    return f"{value:.1f}s"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


_END_TEXT = {
    "killed": "killed (no end recorded)",
    "unknown": "no end recorded (still running, or killed)",
}


def format_report(summary: dict[str, Any]) -> str:
    """A plain-text report of :func:`summarize`'s result, for a terminal."""
    t = summary["totals"]
    lines = [
        f"run {summary['run_id']}: {t['attempts']} attempt(s), {t['restarts']} restart(s)"
        + (f", {t['continuations']} continuation(s)" if t.get("continuations") else ""),
        f"  effective training time ratio  {_fmt_ratio(summary['ettr'])}"
        f"  (useful productive {_fmt_s(t['useful_productive_s'])} of {_fmt_s(t['wall_s'])} wall)",
        f"  device utilisation             {_fmt_ratio(summary['device_utilisation'])}"
        f"  ({t['device_s_held']:.1f} device-s held, gaps before restarts included)",
        f"  productive {_fmt_s(t['productive_s'])}, data wait {_fmt_s(t['data_wait_s'])}, "
        f"checkpoint stalls {_fmt_s(t['checkpoint_stall_s'])}, restarts {_fmt_s(t['restart_s'])}, "
        f"lost work {t['lost_steps']} steps / {_fmt_s(t['lost_s'])}, stragglers {_fmt_s(t['straggler_s'])}",
    ]
    ended_by: dict[int, str] = {}
    for a in summary["attempts"]:
        ended = _END_TEXT.get(a["end_reason"], a["end_reason"])
        if a.get("signal"):
            ended += f" ({a['signal']})"
        if a.get("killed_ranks"):
            ranks = ", ".join(map(str, a["killed_ranks"]))
            ended = f"killed: rank {ranks} recorded no end; the others recorded {a.get('recorded_reason')}"
            if a.get("signal"):
                ended += f" ({a['signal']})"
        if a["last_step"] is None:
            steps = "no step trained" + (
                f" (resumed at step {a['start_step']})" if a["resumed_step"] is not None else ""
            )
        else:
            steps = f"steps {a['start_step']}..{a['last_step']}"
        ended_by[a["attempt"]] = (
            f"killed: rank {', '.join(map(str, a['killed_ranks']))} recorded no end"
            if a.get("killed_ranks")
            else _END_TEXT.get(a["end_reason"], a["end_reason"])
        )
        lines.append(
            f"  attempt {a['attempt']}: world size {a['world_size']}, wall {_fmt_s(a['wall_s'])}, {steps}, "
            f"productive {_fmt_s(a['productive_s'])}, {a['checkpoints']} checkpoint(s), ended: {ended}"
        )
    for c in summary.get("continuations", []):
        lines.append(
            f"  attempt {c['attempt']} continues finished attempt {c['after_attempt']}: "
            f"gap {_fmt_s(c['gap_s'])} (not the run's time), start-up {_fmt_s(c['startup_s'])}"
        )
    for r in summary["restarts"]:
        phases = ", ".join(
            f"{name} {_fmt_s(r[key])}"
            for name, key in (
                ("detection" if r["exit_s"] is not None else "detection, exit and relaunch", "detection_s"),
                ("exit", "exit_s"),
                ("relaunch", "relaunch_s"),
                ("start-up", "startup_s"),
                ("load", "load_s"),
                ("first step", "first_step_s"),
            )
            if r[key] is not None
        )
        lines.append(
            f"  restart before attempt {r['attempt']} (after: {ended_by.get(r['after_attempt'], r['cause'])}): "
            f"{_fmt_s(r['restart_s'])} = {phases}; resumed at step {r['resumed_step']}, "
            f"recomputed {r['lost_steps']} steps ({_fmt_s(r['lost_s'])})"
            + (
                f", world size {r['world_size_before']} -> {r['world_size']}"
                if r["world_size_before"] != r["world_size"]
                else ""
            )
        )
    lines.append(_format_interval(summary["checkpoint_interval"]))
    s = summary["stragglers"]
    latencies = [d["latency_steps"] for d in s["detections"] if d["latency_steps"] is not None]
    lines.append(
        f"  straggler detections: {s['count']}"
        + (f", onset to detection {min(latencies)}..{max(latencies)} steps" if latencies else "")
    )
    for d in s["detections"]:
        ratio = f"{d['ratio']:.2f}x" if isinstance(d["ratio"], (int, float)) else "?"
        lines.append(f"    step {d['step']}: rank {d['suspect_rank']} {ratio} (onset step {d['onset_step']})")
    counts = Counter(i["event"] for i in summary["incidents"])
    if counts:
        lines.append("  incidents: " + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())))
    return "\n".join(lines)


def _format_interval(ci: dict[str, Any]) -> str:
    if ci["stall_s"] is None:
        return "  checkpoint interval: no committed checkpoint recorded, no suggestion"
    cost = f"checkpoint cost to the loop {_fmt_s(ci['stall_s'])} (median; {_fmt_s(ci['total_s'])} in all)"
    if ci["mtbf_source"] == "observed":
        mtbf = f"MTBF {_fmt_s(ci['mtbf_s'])} observed ({ci['failures']} failure(s))"
    elif ci["mtbf_source"] == "given":
        mtbf = f"MTBF {_fmt_s(ci['mtbf_s'])} given" + (
            f" (observed: {_fmt_s(ci['observed_mtbf_s'])})" if ci["observed_mtbf_s"] is not None else ""
        )
    else:
        mtbf = f"no failure observed; MTBF assumed {_fmt_s(ci['mtbf_s'])} (--mtbf-hours to change)"
    if ci["interval_s"] is None:
        return f"  checkpoint interval: {cost}, {mtbf}; checkpoints did not block the loop, no suggestion"
    steps = f" = every ~{ci['interval_steps']} steps" if ci["interval_steps"] is not None else ""
    now = f" (now every {ci['current_interval_steps']:g})" if ci["current_interval_steps"] is not None else ""
    return (
        f"  checkpoint interval (Young-Daly sqrt(2 x cost x MTBF)): {_fmt_s(ci['interval_s'])}{steps}{now}; "
        f"{cost}, {mtbf}"
    )


_COLOURS = {
    "preempted": "tab:red",
    "hang": "tab:purple",
    "straggler": "tab:orange",
    "thermal": "tab:brown",
    "checkpoint_rejected": "tab:gray",
}


def plot_timeline(events: Iterable[dict[str, Any]], out_png: str | os.PathLike[str]) -> None:
    """Draw the run as a PNG: global step over time per attempt, checkpoints, restarts and incidents.

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
        2, 1, figsize=(11, 5), sharex=True, gridspec_kw={"height_ratios": [4, 1]}, constrained_layout=True
    )
    run = [e for e in events if e.get("run_id") == summary["run_id"] and e.get("rank", 0) == 0]
    for a in summary["attempts"]:
        pts = [
            (num(e["time"]) - t0, e["step"])
            for e in run
            if e.get("attempt") == a["attempt"] and e.get("event") in ("progress", "first_step")
            if isinstance(e.get("step"), int)
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=f"attempt {a['attempt']}")
        start, end = a["start_time"] - t0, a["end_time"] - t0
        recovery_end = a["first_step_time"] - t0 if a["first_step_time"] is not None else end
        bars.broken_barh([(start, recovery_end - start)], (0, 1), color="tab:gray", alpha=0.5)
        bars.broken_barh([(recovery_end, end - recovery_end)], (0, 1), color="tab:green", alpha=0.6)
    for e in run:
        if e.get("event") == "checkpoint_committed":
            ax.axvline(num(e["time"]) - t0, color="tab:green", alpha=0.3, linewidth=1)
    seen: set[str] = set()
    for i in summary["incidents"]:
        name = i["event"]
        ax.axvline(
            num(i["time"]) - t0,
            color=_COLOURS[name],
            linestyle="--",
            label=name if name not in seen else None,
        )
        seen.add(name)
    ax.set_ylabel("global step")
    ax.set_title(
        f"run {summary['run_id']}: ETTR {_fmt_ratio(summary['ettr'])}, "
        f"{summary['totals']['restarts']} restart(s), {summary['stragglers']['count']} straggler detection(s)"
    )
    ax.legend(loc="upper left", fontsize="small")
    bars.set_yticks([])
    bars.set_xlabel("seconds since the first process start (grey: recovery, green: training)")
    fig.savefig(os.fspath(out_png), dpi=100)
    plt.close(fig)
