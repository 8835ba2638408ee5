"""A run's history from its event log: its attempts, how each ended, and what linked each attempt to the next.

Pure functions over the events of :func:`~lightning_ft.events.read_events`; :mod:`~lightning_ft.monitors.goodput_report`
adds them up. The rules, in one place:

- An attempt ends with the reason of its ``attempt_end`` events (``finished``, ``preempted``, ``hung``, ``crashed``,
  ``stopped``); when ranks disagree, the earliest reason other than ``finished`` is the cause. An attempt without
  ``attempt_end`` was killed (a later attempt followed) or is still running (``unknown``, the last attempt). When
  every rank records its end but some rank of an attempt did not, that rank was killed and the attempt ended
  ``killed`` whatever the others wrote (they were stopped because of it; ``recorded_reason`` keeps what they wrote).
- An attempt's steps run from the step it resumed at (``resumed.step``; for a replica group that started beside a
  live quorum, the step its ``healed`` event copied from a live group before its first step) to the highest step its
  records show (its live-step events,
  its own ``checkpoint_committed`` saves and ``fault_injected``); records with a lower step were written before the
  checkpoint was restored (a crash while loading), and an attempt that trained no step has ``last_step`` ``None``.
  Logs without ``attempt_end`` (lightning-ft 0.1.0) fall back on ``hang`` and ``preempted`` events.
- An attempt's productive time is what its ``progress`` lines measured, plus, for the steps it trained after its last
  ``progress`` line (a process killed outright, a hang: nothing wrote the line), those steps times a step time:
  the attempt's own (its ``progress`` lines' productive time over the steps they cover), else that of the run's other
  attempts at the same world size, else at any, else the wall time from its ``first_step`` to the time its last step
  was recorded, over those steps. The record names them: ``estimated_steps``, ``estimated_productive_s``.
- An attempt that follows a ``finished`` one is a *continuation* (the run was launched again to train longer): the
  wall-clock gap between them is not lost time and no step counts as recomputed. Any other next attempt is a
  *restart*: the time from the fault to its first step is restart time, the gap is part of the run's wall time, and
  the steps the stopped attempt reached beyond the checkpoint it resumed from were recomputed. A replica group's
  attempt that healed from a live group (no ``resumed``) started at the live step, which the live groups committed:
  it recomputed nothing that the stopped attempt had reached below it.
- A restart's time is split into: *detection*, from the fault (the first ``signal_time`` of a preemption; a hang's
  last progress, ``hang`` time minus ``idle_s``; the first ``attempt_end`` of a crash or a stop) to the last rank's
  ``attempt_end`` (for a kill, from the first record of the attempt's last step to the next process start, which then
  holds exit and relaunch too); *exit*, to the stopped attempt's last record; *relaunch*, to the next attempt's
  process start; *start-up*, from that process start until the checkpoint load began (``resumed.startup_s``:
  imports, process group, model set-up; ``None`` when not recorded); *load*, ``resumed.load_s``; and *first step*,
  the rest of the time to the next attempt's ``first_step``.
- An attempt's ``checkpoints`` and ``checkpoint_steps`` are its durable saves (``checkpoint_committed`` without
  ``tier``, or ``tier="durable"``); ``memory_checkpoints`` counts its memory-tier saves, and ``resumed_tier`` names
  the tier its ``resumed`` event restored from (``"durable"`` when the event names none, ``None`` without one).
  :mod:`~lightning_ft.monitors.checkpoint_tiers` adds them up per tier.
- A restart is a *failure* (for the mean time between failures) when the attempt hung, crashed or was killed, or when
  a preemption or a stop recomputed steps (its own checkpoint did not hold its last step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

LIVE_STEP_EVENTS = frozenset(
    {"progress", "first_step", "straggler", "straggler_cleared", "thermal", "preempted", "hang", "attempt_end"}
)
"""Events whose ``step`` is the global step when written (checkpoint events carry the checkpoint's step instead)."""
_TRAINED_STEP_EVENTS = LIVE_STEP_EVENTS | {"checkpoint_committed", "fault_injected"}
"""Events whose ``step`` the attempt had trained when it wrote them (an attempt's own save holds a step it reached)."""
RECORDED_ENDS = ("finished", "preempted", "hung", "crashed", "stopped")
"""The ``reason`` of an ``attempt_end`` event."""
INFERRED_ENDS = ("killed", "unknown")
"""An attempt without ``attempt_end``: ``killed`` when another attempt followed, ``unknown`` for the last one."""
_FAILURES = frozenset({"hung", "crashed", "killed", "unknown"})


def num(value: Any, default: float = 0.0) -> float:
    """``value`` as a float when it is a finite number, else ``default``."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else default


def latest_run(events: Iterable[dict[str, Any]]) -> tuple[str | None, dict[int, list[dict[str, Any]]]]:
    """The run of the last event (a log folder may hold several), and its events by attempt, each in time order."""
    ordered = sorted(events, key=lambda e: (num(e.get("time")), e.get("rank", 0)))
    if not ordered:
        return None, {}
    run_id = ordered[-1].get("run_id")
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in ordered:
        if e.get("run_id") == run_id:
            by_attempt.setdefault(int(e.get("attempt", 0) or 0), []).append(e)
    return run_id, dict(sorted(by_attempt.items()))


def highest_step(events: Iterable[dict[str, Any]], run_id: str, *, before_attempt: int) -> int:
    """The highest global step that an attempt of ``run_id`` earlier than ``before_attempt`` recorded; -1 if none."""
    steps = [
        e["step"]
        for e in events
        if e.get("run_id") == run_id
        and int(e.get("attempt", 0) or 0) < before_attempt
        and e.get("event") in LIVE_STEP_EVENTS
        and isinstance(e.get("step"), int)
    ]
    return max(steps, default=-1)


def attempts(by_attempt: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per attempt (see :func:`~lightning_ft.monitors.goodput_report.summarize` for the fields)."""
    writers = {e.get("rank", 0) for evs in by_attempt.values() for e in evs if e.get("event") == "attempt_end"}
    records = [_attempt(a, evs, every_rank_ends=len(writers) > 1) for a, evs in by_attempt.items()]
    for record in records[:-1]:
        if record["end_reason"] == "unknown":
            record["end_reason"] = "killed"
    for record in records:
        _estimate_unrecorded_steps(record, records)
    return records


def _measured_step_s(records: Iterable[dict[str, Any]]) -> float | None:
    """Productive seconds per step that ``records``' ``progress`` lines measured, or ``None`` (none measured)."""
    steps = seconds = 0.0
    for r in records:
        if r["_recorded_steps"] > 0 and r["_recorded_productive_s"] > 0:
            steps += r["_recorded_steps"]
            seconds += r["_recorded_productive_s"]
    return seconds / steps if steps else None


def _estimate_unrecorded_steps(record: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Add the productive time of the steps ``record`` trained after its last ``progress`` line (module docstring)."""
    last = record["last_step"]
    unrecorded = max(last - record["_progress_step"], 0) if last is not None else 0
    record["estimated_steps"], record["estimated_productive_s"] = unrecorded, 0.0
    if not unrecorded:
        return
    others = [r for r in records if r is not record]
    same_size = [r for r in others if r["world_size"] == record["world_size"]]
    step_s = _measured_step_s([record]) or _measured_step_s(same_size) or _measured_step_s(others)
    first, first_step = record["first_step_time"], record["_first_step_step"]
    if step_s is None and first is not None and first_step is not None and last > first_step:
        step_s = max(record["_last_step_time"] - first, 0.0) / (last - first_step)
    if step_s is None:  # one step on record and nothing measured anywhere: no estimate
        record["estimated_steps"] = 0
        return
    estimate = unrecorded * step_s
    record["estimated_productive_s"] = estimate
    record["productive_s"] += estimate
    record["_progress"].append((last, estimate))


def _attempt(attempt: int, evs: list[dict[str, Any]], *, every_rank_ends: bool) -> dict[str, Any]:
    starts = [e for e in evs if e.get("event") == "attempt_start"]
    start_times = [num(e.get("process_start_time"), num(e.get("time"))) for e in starts]
    start_time = min(start_times) if start_times else num(evs[0].get("time"))
    end_time = max(num(e.get("time")) for e in evs)
    world_sizes = [int(e["world_size"]) for e in starts if isinstance(e.get("world_size"), int)]
    world_size = max(world_sizes) if world_sizes else max((int(e.get("rank", 0) or 0) for e in evs), default=0) + 1
    rank0 = [e for e in evs if e.get("rank", 0) == 0]
    progress = [e for e in rank0 if e.get("event") == "progress"]
    first = next((e for e in rank0 if e.get("event") == "first_step"), None)
    resumed = next((e for e in rank0 if e.get("event") == "resumed"), None)
    resumed_step = int(resumed["step"]) if resumed is not None and isinstance(resumed.get("step"), int) else None
    healed_step = _healed_step(rank0, first) if resumed_step is None else None
    stepped = [e for e in evs if e.get("event") in _TRAINED_STEP_EVENTS and isinstance(e.get("step"), int)]
    if resumed_step is not None:  # records written before the checkpoint's step was restored (a crash while loading)
        stepped = [e for e in stepped if e["step"] >= resumed_step]
    steps = [e["step"] for e in stepped]
    last_step = max(steps) if steps else None
    # When the attempt was last seen at its last step: where a kill's fault is placed, and an estimate's end.
    last_step_time = min(
        (num(e.get("last_step_time"), num(e.get("time"))) for e in stepped if e["step"] == last_step), default=None
    )
    progress_steps = [e["step"] for e in progress if isinstance(e.get("step"), int)]
    committed = [e for e in rank0 if e.get("event") == "checkpoint_committed"]
    durable = [e for e in committed if e.get("tier") in (None, "durable")]  # no tier: a log older than the tiers
    last_progress_time = num(progress[-1].get("time")) if progress else None
    record = {
        "attempt": attempt,
        "world_size": world_size,
        "start_time": start_time,
        "end_time": end_time,
        "wall_s": max(end_time - start_time, 0.0),
        "first_step_time": num(first.get("time")) if first else None,
        "recovery_s": num(first.get("time")) - start_time if first else None,
        "resumed_step": resumed_step,
        "healed_step": healed_step,
        "resumed_tier": (str(resumed.get("tier") or "durable")) if resumed is not None else None,
        "load_s": num(resumed.get("load_s"), math.nan) if resumed is not None else math.nan,
        "resume_startup_s": num(resumed.get("startup_s"), math.nan) if resumed is not None else math.nan,
        "start_step": resumed_step or healed_step or 0,
        "last_step": last_step,
        "last_progress_time": last_progress_time,
        "productive_s": sum(num(e.get("productive_s")) for e in progress),
        "estimated_steps": 0,
        "estimated_productive_s": 0.0,
        "data_wait_s": sum(num(e.get("data_wait_s")) for e in progress),
        "checkpoint_stall_s": _checkpoint_stall_s(progress, committed),
        "checkpoints": len(durable),
        "memory_checkpoints": len(committed) - len(durable),
        "checkpoint_steps": [e["step"] for e in durable if isinstance(e.get("step"), int)],
        "lost_steps": 0,
        "lost_s": 0.0,
        "_progress": [(int(e["step"]), num(e.get("productive_s"))) for e in progress if isinstance(e.get("step"), int)],
        "_progress_step": max(progress_steps, default=resumed_step or healed_step or 0),
        "_recorded_steps": max(max(progress_steps, default=0) - (resumed_step or healed_step or 0), 0),
        "_recorded_productive_s": sum(num(e.get("productive_s")) for e in progress),
        "_first_step_step": first["step"] if first is not None and isinstance(first.get("step"), int) else None,
        "_last_step_time": last_step_time,
    }
    seen_alive = last_step_time if last_step_time is not None else last_progress_time
    record.update(_end(evs, starts, every_rank_ends=every_rank_ends, last_seen_time=seen_alive))
    for key in ("load_s", "resume_startup_s"):
        if record[key] != record[key]:  # NaN: not recorded
            record[key] = None
    return record


def _healed_step(rank0: list[dict[str, Any]], first: dict[str, Any] | None) -> int | None:
    """The step a replica group's attempt healed to from a live group before its first step (it then trains on from
    there, as from a resume), or ``None``: no heal, or a heal later on (a live group that missed a quorum)."""
    healed = next((e for e in rank0 if e.get("event") == "healed" and isinstance(e.get("step"), int)), None)
    if healed is None or (first is not None and num(healed.get("time")) > num(first.get("time"))):
        return None
    return int(healed["step"])


def _end(
    evs: list[dict[str, Any]],
    starts: list[dict[str, Any]],
    *,
    every_rank_ends: bool,
    last_seen_time: float | None,
) -> dict[str, Any]:
    """How the attempt ended: ``end_reason``, ``fault_time`` and ``stop_time`` (the last rank's ``attempt_end``).
    ``last_seen_time``: when a record first showed the attempt's last step (a kill's fault time)."""
    ends = [e for e in evs if e.get("event") == "attempt_end"]
    preempted = [e for e in evs if e.get("event") == "preempted"]
    hangs = [e for e in evs if e.get("event") == "hang"]
    out: dict[str, Any] = {"end_reason": "unknown", "fault_time": None, "stop_time": None, "killed_ranks": []}
    if preempted:
        out["signal"] = preempted[0].get("signal")
    missing = sorted({e.get("rank", 0) for e in starts} - {e.get("rank", 0) for e in ends})
    if ends and every_rank_ends and missing:
        recorded = [e for e in ends if e.get("reason") != "finished"] or ends
        out.update(end_reason="killed", killed_ranks=missing, recorded_reason=str(recorded[0].get("reason")))
    elif ends:
        causes = [e for e in ends if e.get("reason") != "finished"]
        out["end_reason"] = str((causes or ends)[0].get("reason", "unknown"))
        out["stop_time"] = max(num(e.get("time")) for e in ends)
    elif hangs:  # 0.1.0 logs: no attempt_end
        out["end_reason"] = "hung"
    elif preempted:
        out["end_reason"] = "preempted"
    reason = out["end_reason"]
    if reason == "preempted" and preempted:
        out["fault_time"] = min(num(e.get("signal_time"), num(e.get("time"))) for e in preempted)
    elif reason == "hung" and hangs:
        out["fault_time"] = min(num(e.get("time")) - num(e.get("idle_s")) for e in hangs)
    elif reason in ("crashed", "stopped", "hung", "preempted") and ends:
        out["fault_time"] = min(num(e.get("time")) for e in ends)
    elif reason in INFERRED_ENDS:
        out["fault_time"] = last_seen_time
    if out["stop_time"] is None and reason in ("preempted", "hung") and (preempted or hangs):
        out["stop_time"] = max(num(e.get("time")) for e in preempted + hangs)
    return out


def link(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    """What happened between two consecutive attempts: a continuation or a restart, with its time split into phases.

    Sets ``prev["lost_steps"]`` and ``prev["lost_s"]`` for a restart.
    """
    gap_s = max(cur["start_time"] - prev["end_time"], 0.0)
    if prev["end_reason"] == "finished":
        return {
            "attempt": cur["attempt"],
            "after_attempt": prev["attempt"],
            "gap_s": gap_s,
            "startup_s": cur["recovery_s"],
        }
    resume_step = cur["start_step"]  # the checkpoint's step, the live step a heal copied, else 0
    lost_steps = max(prev["last_step"] - resume_step, 0) if prev["last_step"] is not None else 0
    lost_s = _lost_productive_s(prev["_progress"], prev["start_step"], resume_step)
    prev["lost_steps"], prev["lost_s"] = lost_steps, lost_s
    fault = prev["fault_time"]
    if fault is None:
        fault = prev["last_progress_time"] if prev["last_progress_time"] is not None else prev["start_time"]
    first = cur["first_step_time"]
    load = cur["load_s"]
    phases: dict[str, float | None]
    if prev["stop_time"] is None:  # killed: nothing recorded the stop; torchrun's teardown and relaunch are in here
        phases = {"detection_s": max(cur["start_time"] - fault, 0.0), "exit_s": None, "relaunch_s": None}
    else:
        stop = max(prev["stop_time"], fault)
        phases = {
            "detection_s": stop - fault,
            "exit_s": max(prev["end_time"] - stop, 0.0),
            "relaunch_s": gap_s,
        }
    startup = cur["resume_startup_s"]
    phases["startup_s"] = startup
    phases["load_s"] = load
    phases["first_step_s"] = (
        (first - cur["start_time"] - (startup or 0.0) - (load or 0.0)) if first is not None else None
    )
    cause = prev["end_reason"]
    return {
        "attempt": cur["attempt"],
        "after_attempt": prev["attempt"],
        "cause": cause,
        "failure": cause in _FAILURES or lost_steps > 0,
        "fault_time": fault,
        "restart_s": first - fault if first is not None else None,
        "recovery_s": cur["recovery_s"],
        **phases,
        "gap_s": gap_s,
        "resumed_step": resume_step,
        "healed": cur["healed_step"] is not None,
        "resumed_tier": cur["resumed_tier"],
        "lost_steps": lost_steps,
        "lost_s": lost_s,
        "world_size_before": prev["world_size"],
        "world_size": cur["world_size"],
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


def _checkpoint_stall_s(progress: list[dict[str, Any]], committed: list[dict[str, Any]]) -> float:
    """The seconds saves blocked the training loop in one attempt: the ``stall_s`` of its ``progress`` lines, which
    come from the timer that also measured their ``data_wait_s`` (the figure ``GoodputMonitor`` logs); in a log
    written before progress lines carried it, the ``stall_s`` of its committed checkpoints."""
    if any("stall_s" in e for e in progress):
        return sum(num(e.get("stall_s")) for e in progress)
    return sum(num(e.get("stall_s")) for e in committed)
