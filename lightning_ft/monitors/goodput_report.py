"""Goodput of a run from its event log: where the wall time of every attempt went, as numbers and as a timeline.

Pure functions over the events of :func:`~lightning_ft.events.read_events` (docs/strategy.md, "Event log").
:class:`~lightning_ft.monitors.goodput_monitor.GoodputMonitor` uses them live; ``lightning-ft report LOGDIR`` prints
:func:`format_report` of :func:`summarize` and can draw :func:`plot_timeline`.

Definitions (all wall-clock seconds):

- an attempt runs from its process start (``attempt_start.process_start_time``, else the ``attempt_start`` time) to
  its last event;
- productive time is the step time of the ``progress`` events; *useful* productive time leaves out the steps that a
  later attempt computed again (lost work);
- restart time of attempt ``a > 0`` runs from the last ``progress`` of attempt ``a - 1`` to the ``first_step`` of
  ``a``; recovery is the part from ``a``'s process start to that first step;
- lost steps are the steps ``a - 1`` reached beyond the checkpoint ``a`` resumed from (``resumed.step``, 0 without a
  ``resumed`` event); lost time is the productive time ``a - 1`` spent on them, prorated within ``progress`` intervals;
- effective training time ratio (ETTR) = useful productive time / the summed wall time of all attempts;
- device utilisation = useful productive device-seconds / device-seconds held from the first process start to the
  last event, gaps between attempts included (device-seconds: seconds times the attempt's world size).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

# Events whose "step" is the global step when written (checkpoint events carry the checkpoint's step instead).
_LIVE_STEP_EVENTS = {"progress", "first_step", "straggler", "straggler_cleared", "thermal", "preempted", "hang"}
INCIDENT_EVENTS = ("preempted", "hang", "straggler", "thermal", "checkpoint_rejected")


def _num(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else default


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Goodput summary of one run (the run of the last event, if the log holds several).

    Returns a JSON-able dict: ``attempts`` (one dict per attempt), ``restarts`` (one per attempt after the first),
    ``totals``, ``ettr``, ``device_utilisation``, ``stragglers`` and ``incidents``. Ratios are ``None`` when the log
    holds no wall time.
    """
    events = sorted(events, key=lambda e: (_num(e.get("time")), e.get("rank", 0)))
    if events:
        run_id = events[-1].get("run_id")
        events = [e for e in events if e.get("run_id") == run_id]
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        by_attempt.setdefault(int(e.get("attempt", 0) or 0), []).append(e)

    attempts = [_attempt(a, evs) for a, evs in sorted(by_attempt.items())]
    restarts = []
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        resume_step = cur["resumed_step"] if cur["resumed_step"] is not None else 0
        lost_steps = max(prev["last_step"] - resume_step, 0) if prev["last_step"] is not None else 0
        lost_s = _lost_productive_s(prev["_progress"], prev["start_step"], resume_step)
        prev["lost_steps"], prev["lost_s"] = lost_steps, lost_s
        since = prev["last_progress_time"] if prev["last_progress_time"] is not None else prev["start_time"]
        first = cur["first_step_time"]
        restarts.append(
            {
                "attempt": cur["attempt"],
                "restart_s": first - since if first is not None else None,
                "recovery_s": cur["recovery_s"],
                "gap_s": max(cur["start_time"] - prev["end_time"], 0.0),
                "resumed_step": resume_step,
                "lost_steps": lost_steps,
                "lost_s": lost_s,
                "cause": prev["end_reason"],
            }
        )

    wall_s = sum(a["wall_s"] for a in attempts)
    productive_s = sum(a["productive_s"] for a in attempts)
    lost_s = sum(a["lost_s"] for a in attempts)
    useful_device_s = sum((a["productive_s"] - a["lost_s"]) * a["world_size"] for a in attempts)
    held_device_s = sum(a["wall_s"] * a["world_size"] for a in attempts) + sum(
        r["gap_s"] * a["world_size"] for r, a in zip(restarts, attempts[1:], strict=True)
    )
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
    totals = {
        "attempts": len(attempts),
        "restarts": len(restarts),
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
        "straggler_s": sum(_num(e.get("lost_s")) for e in events if e.get("event") == "straggler_cleared"),
        "device_s_held": held_device_s,
    }
    incidents = [
        {k: e.get(k) for k in ("time", "attempt", "rank", "event", "step")} | _incident_detail(e)
        for e in events
        if e.get("event") in INCIDENT_EVENTS and (e.get("event") != "thermal" or e.get("reasons"))
    ]
    for a in attempts:
        del a["_progress"]
    return {
        "run_id": events[-1].get("run_id") if events else None,
        "attempts": attempts,
        "restarts": restarts,
        "totals": totals,
        "ettr": (productive_s - lost_s) / wall_s if wall_s > 0 else None,
        "device_utilisation": useful_device_s / held_device_s if held_device_s > 0 else None,
        "stragglers": {"count": len(detections), "detections": detections, "lost_s": totals["straggler_s"]},
        "incidents": incidents,
    }


def _incident_detail(e: dict[str, Any]) -> dict[str, Any]:
    keys = {
        "preempted": ("signal",),
        "hang": ("idle_s", "ranks"),
        "straggler": ("suspect_rank", "ratio", "onset_step"),
        "thermal": ("device", "reasons", "temperature_c", "sm_clock_mhz"),
        "checkpoint_rejected": ("path", "reason"),
    }[e["event"]]
    return {k: e.get(k) for k in keys}


def _attempt(attempt: int, evs: list[dict[str, Any]]) -> dict[str, Any]:
    starts = [e for e in evs if e.get("event") == "attempt_start"]
    start_times = [_num(e.get("process_start_time"), _num(e.get("time"))) for e in starts]
    start_time = min(start_times) if start_times else _num(evs[0].get("time"))
    end_time = max(_num(e.get("time")) for e in evs)
    world_sizes = [int(e["world_size"]) for e in starts if isinstance(e.get("world_size"), int)]
    world_size = max(world_sizes) if world_sizes else max((int(e.get("rank", 0) or 0) for e in evs), default=0) + 1
    rank0 = [e for e in evs if e.get("rank", 0) == 0]
    progress = [e for e in rank0 if e.get("event") == "progress"]
    first = next((e for e in rank0 if e.get("event") == "first_step"), None)
    resumed = next((e for e in rank0 if e.get("event") == "resumed"), None)
    resumed_step = int(resumed["step"]) if resumed is not None and isinstance(resumed.get("step"), int) else None
    steps = [e["step"] for e in evs if e.get("event") in _LIVE_STEP_EVENTS and isinstance(e.get("step"), int)]
    committed = [e for e in rank0 if e.get("event") == "checkpoint_committed"]
    reason = "unknown"
    for name in ("preempted", "hang"):
        if any(e.get("event") == name for e in evs):
            reason = name
    return {
        "attempt": attempt,
        "world_size": world_size,
        "start_time": start_time,
        "end_time": end_time,
        "wall_s": max(end_time - start_time, 0.0),
        "first_step_time": _num(first.get("time")) if first else None,
        "recovery_s": _num(first.get("time")) - start_time if first else None,
        "resumed_step": resumed_step,
        "start_step": resumed_step or 0,
        "last_step": max(steps) if steps else None,
        "last_progress_time": _num(progress[-1].get("time")) if progress else None,
        "productive_s": sum(_num(e.get("productive_s")) for e in progress),
        "data_wait_s": sum(_num(e.get("data_wait_s")) for e in progress),
        "checkpoint_stall_s": sum(_num(e.get("stall_s")) for e in committed),
        "checkpoints": len(committed),
        "lost_steps": 0,
        "lost_s": 0.0,
        "end_reason": reason,
        "_progress": [
            (int(e["step"]), _num(e.get("productive_s"))) for e in progress if isinstance(e.get("step"), int)
        ],
    }


def _lost_productive_s(progress: list[tuple[int, float]], start_step: int, resume_step: int) -> float:
    """Productive seconds spent on steps above ``resume_step``, each progress interval prorated by its steps."""
    lost = 0.0
    prev = start_step
    for step, productive_s in progress:
        if step > prev:
            above = step - max(prev, resume_step)
            lost += productive_s * min(max(above / (step - prev), 0.0), 1.0)
        prev = step
    return lost


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_report(summary: dict[str, Any]) -> str:
    """A plain-text report of :func:`summarize`'s result, for a terminal."""
    t = summary["totals"]
    lines = [
        f"run {summary['run_id']}: {t['attempts']} attempt(s), {t['restarts']} restart(s)",
        f"  effective training time ratio  {_fmt_ratio(summary['ettr'])}"
        f"  (useful productive {_fmt_s(t['useful_productive_s'])} of {_fmt_s(t['wall_s'])} wall)",
        f"  device utilisation             {_fmt_ratio(summary['device_utilisation'])}"
        f"  ({t['device_s_held']:.1f} device-s held, gaps between attempts included)",
        f"  productive {_fmt_s(t['productive_s'])}, data wait {_fmt_s(t['data_wait_s'])}, "
        f"checkpoint stalls {_fmt_s(t['checkpoint_stall_s'])}, restarts {_fmt_s(t['restart_s'])}, "
        f"lost work {t['lost_steps']} steps / {_fmt_s(t['lost_s'])}, stragglers {_fmt_s(t['straggler_s'])}",
    ]
    for a in summary["attempts"]:
        lines.append(
            f"  attempt {a['attempt']}: world size {a['world_size']}, wall {_fmt_s(a['wall_s'])}, "
            f"steps {a['start_step']}..{a['last_step'] if a['last_step'] is not None else '-'}, "
            f"productive {_fmt_s(a['productive_s'])}, {a['checkpoints']} checkpoint(s), ended: {a['end_reason']}"
        )
    for r in summary["restarts"]:
        lines.append(
            f"  restart before attempt {r['attempt']}: {_fmt_s(r['restart_s'])} (recovery {_fmt_s(r['recovery_s'])}), "
            f"resumed at step {r['resumed_step']}, lost {r['lost_steps']} steps ({_fmt_s(r['lost_s'])}), "
            f"after: {r['cause']}"
        )
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
            (_num(e["time"]) - t0, e["step"])
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
            ax.axvline(_num(e["time"]) - t0, color="tab:green", alpha=0.3, linewidth=1)
    seen: set[str] = set()
    for i in summary["incidents"]:
        name = i["event"]
        ax.axvline(
            _num(i["time"]) - t0,
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
