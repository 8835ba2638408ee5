"""The whole job of replica groups, from every group's event log: ``lightning-ft report FOLDER`` on a folder that holds
the groups' runs (docs/replica-groups-reference.md, "One report for the job").

Each replica group is its own torchrun job with its own run (its own run id and event log, under its own
``default_root_dir`` or as one of the runs of a shared one). Group rank 0 writes ``replica_group {replica_id,
lighthouse, group_size, num_groups}`` before its first quorum: the lighthouse's address is the job (every group of a
job joins the same lighthouse), the replica id the group. :func:`find_group_runs` finds those runs under a folder;
:func:`summarize_job` joins them:

- ``live_groups``: the number of live groups over time (each change once: every live group records the same
  membership at the same step);
- ``failures``: each group lost from the quorum once (the ``replica_lost`` of every survivor merged): which group,
  how it left when its own log says (evicted and by what, hung, crashed, stopped; ``lost`` when its log just ends: a
  kill, a lost node), the stall (the longest any survivor waited) and the steps discarded;
- ``heals``: each heal of a joining group, with its source group, bytes and seconds;
- ``lighthouse``: each outage of the lighthouse once (the groups' ``lighthouse_outage`` whose down times overlap,
  merged): when, how long it did not answer (the longest any group saw) and the stall (the longest quorum wait of a
  group), and each time it stayed away past ``lighthouse_wait`` (``lighthouse_lost``: the groups that stopped, the
  time they waited, the checkpoint committed);
- ``groups``: per group, its attempts (steps, how each ended) and the single-run report's own ETTR;
- the job's effective training time ratio, measured as the single-run report measures a run's (the time of the
  steps trained, less the steps discarded, over the wall time; never below 0), with each committed step counted once
  for the job: the groups of a quorum train the same step side by side, a whole-job restart trains some steps again.
  A step's time is the productive time the groups' ``progress`` records give it (the median over the groups that
  trained it); a failure's discarded steps cost that time each, and the rest of its stall (the wait for the next
  quorum) is wall time no step was trained in, counted once that way. A lighthouse outage is such a wait too: the
  wall time holds it, nothing is subtracted for it. The wall time runs from the first group's process start to the end
  of the last attempt that trained a step.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.replica_goodput import replica_summary
from lightning_ft.monitors.run_history import latest_run, num

__all__ = ["find_group_runs", "format_job_report", "summarize_job"]

_UNKNOWN_JOB = "unknown lighthouse"


def find_group_runs(folder: str | Path) -> list[dict[str, Any]]:
    """Every run of a replica group under ``folder`` (any depth): one dict per run with ``folder`` (its event log's
    folder), ``run_id``, ``replica_id``, ``job`` (the lighthouse address) and ``events``, in the order of the replica
    ids. A run is a group's when its log holds ``replica_group`` (or, for a log older than that event, any replica
    event: its group is then named after its folder)."""
    from lightning_ft.events import read_events

    root = Path(folder)
    folders = sorted({p.parent for p in root.rglob("rank*.jsonl") if p.parent.name == "events"})
    runs: list[dict[str, Any]] = []
    for events_folder in folders:
        by_run: dict[str, list[dict[str, Any]]] = {}
        for e in read_events(events_folder):
            by_run.setdefault(str(e.get("run_id")), []).append(e)
        for run_id, events in by_run.items():
            group = next((e for e in events if e.get("event") == "replica_group"), None)
            if group is None and replica_summary(events) is None:
                continue
            owner = _run_folder(events_folder)
            runs.append(
                {
                    "folder": str(owner),
                    "run_id": run_id,
                    "replica_id": str(group["replica_id"]) if group else owner.name,
                    "job": str(group.get("lighthouse")) if group else _UNKNOWN_JOB,
                    "group_size": group.get("group_size") if group else None,
                    "events": events,
                }
            )
    return sorted(runs, key=lambda r: (r["job"], _id_key(r["replica_id"]), r["folder"]))


def _run_folder(events_folder: Path) -> Path:
    """The folder a user would pass for the single-run report: the ``default_root_dir`` (``<root>/lightning-ft/
    events``) or another run's folder (``<root>/lightning-ft/runs/<run_id>/events``)."""
    parent = events_folder.parent
    return parent.parent if parent.name in ("lightning-ft", "lightning_ft") else parent


def _id_key(replica_id: str) -> tuple[int, Any]:
    return (0, int(replica_id)) if replica_id.isdigit() else (1, replica_id)


def summarize_job(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One job's summary from its groups' runs (:func:`find_group_runs`, all of one ``job``). JSON-able; times are
    seconds, ``t`` fields seconds from the job's start. Keys: ``job``, ``start_time``, ``wall_s``,
    ``committed_steps``, ``step_s`` (the committed steps' time, each once), ``stall_s``, ``discarded_s`` (the discarded
    steps' time), ``ettr``, ``discarded_steps``, ``live_groups``, ``failures``, ``heals``, ``lighthouse`` and
    ``groups`` (module docstring)."""
    runs = list(runs)
    if not runs:
        raise ValueError("summarize_job(runs=[]): no replica group's run to summarize")
    per_run = [(run, summarize(run["events"])) for run in runs]
    attempts = [(run, a) for run, s in per_run for a in s["attempts"]]
    start = min(a["start_time"] for _, a in attempts)
    trained = [a for _, a in attempts if a["last_step"] is not None and a["first_step_time"] is not None]
    end = max((a["end_time"] for a in trained), default=max(a["end_time"] for _, a in attempts))
    failures = _failures(runs, per_run, start)
    heals = _heals(runs, start)
    steps, step_s = _committed_step_time(runs)
    stall_s = sum(f["stall_s"] for f in failures)
    discarded = sum(f["discarded_steps"] for f in failures)
    discarded_s = discarded * step_s / steps if steps else 0.0
    wall_s = max(end - start, 0.0)
    lighthouse = _lighthouse(runs, start)
    return {
        "job": runs[0]["job"],
        "start_time": start,
        "wall_s": wall_s,
        "committed_steps": steps,
        "step_s": step_s,
        "stall_s": stall_s,
        "discarded_s": discarded_s,
        "ettr": max(step_s - discarded_s, 0.0) / wall_s if wall_s > 0 else None,
        "discarded_steps": discarded,
        "live_groups": _live_groups(runs, start),
        "failures": failures,
        "heals": heals,
        "lighthouse": lighthouse,
        "groups": [_group(run, s, start) for run, s in per_run],
    }


def _live_groups(runs: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    """``{t, step, live_groups}`` at each change of the number of live groups, in time order."""
    seen: dict[tuple[Any, Any], float] = {}
    for run in runs:
        for e in run["events"]:
            if e.get("event") == "replica_quorum" and isinstance(e.get("live_groups"), int):
                key = (e.get("step"), e["live_groups"])
                seen[key] = min(seen.get(key, float("inf")), num(e.get("time")))
    changes: list[dict[str, Any]] = []
    for (step, live), t in sorted(seen.items(), key=lambda kv: kv[1]):
        if not changes or changes[-1]["live_groups"] != live:
            changes.append({"t": t - start, "step": step, "live_groups": live})
    return changes


def _failures(
    runs: list[dict[str, Any]], per_run: list[tuple[dict[str, Any], dict[str, Any]]], start: float
) -> list[dict[str, Any]]:
    """Each group lost from the quorum once: the survivors' ``replica_lost`` merged, with how the group left."""
    merged: dict[tuple[str, Any], dict[str, Any]] = {}
    for run in runs:
        for e in run["events"]:
            if e.get("event") != "replica_lost":
                continue
            key = (str(e.get("replica_id")), e.get("step"))
            record = merged.setdefault(
                key,
                {
                    "replica_id": key[0],
                    "step": key[1],
                    "time": num(e.get("time")),
                    "stall_by_group": {},
                    "discarded": 0,
                },
            )
            record["time"] = min(record["time"], num(e.get("time")))
            stall = num(e.get("stall_s"))
            record["stall_by_group"][run["replica_id"]] = max(record["stall_by_group"].get(run["replica_id"], 0), stall)
            record["discarded"] = max(record["discarded"], int(num(e.get("discarded_steps"))))
    out = []
    for r in sorted(merged.values(), key=lambda r: r["time"]):
        how, detail = _how_it_left(r["replica_id"], r["time"], per_run, r["step"])
        out.append(
            {
                "t": r["time"] - start,
                "step": r["step"],
                "replica_id": r["replica_id"],
                "how": how,
                "detail": detail,
                "stall_s": max(r["stall_by_group"].values(), default=0.0),
                "stall_by_group": r["stall_by_group"],
                "discarded_steps": r["discarded"],
            }
        )
    return out


def _how_it_left(
    replica_id: str, seen_at: float, per_run: list[tuple[dict[str, Any], dict[str, Any]]], loss_step: Any = None
) -> tuple[str, str | None]:
    """How group ``replica_id`` left before ``seen_at`` (when a survivor recorded the loss, at ``loss_step``), from
    its own log: its attempt that started last before then (``rejoined`` when that attempt trained past the loss).
    An attempt whose first step comes after the loss is the group's relaunch, not the attempt that left, even when it
    started before the survivors recorded the loss (a long stall, or a relaunch into the lost group's run)."""
    candidates = [
        (a, run)
        for run, s in per_run
        if run["replica_id"] == replica_id
        for a in s["attempts"]
        if a["start_time"] <= seen_at and not _first_step_after(run, a["attempt"], loss_step)
    ]
    if not candidates:
        return "lost", f"no event log of group {replica_id} under the folder"
    attempt, run = max(candidates, key=lambda ar: ar[0]["start_time"])
    within = [
        e
        for e in run["events"]
        if int(e.get("attempt", 0) or 0) == attempt["attempt"] and e.get("event") in ("node_evicted", "hang")
    ]
    evicted = next((e for e in within if e["event"] == "node_evicted"), None)
    if evicted is not None:
        return "evicted", f"{evicted.get('source')}: {evicted.get('reason')}"
    if any(e["event"] == "hang" for e in within) or attempt["end_reason"] == "hung":
        return "hung", "its watchdog reported a hang"
    if isinstance(loss_step, int) and attempt["last_step"] is not None and attempt["last_step"] > loss_step:
        return "rejoined", "it missed a quorum and trained on after a heal: its process never stopped"
    reason = attempt["end_reason"]
    if reason in ("crashed", "stopped", "preempted", "finished"):
        return reason, None
    return "lost", "its log ends without a record (killed, or its node went away)"


def _first_step_after(run: dict[str, Any], attempt: int, step: Any) -> bool:
    """Whether attempt ``attempt`` of ``run`` trained its first step after ``step``."""
    first = next(
        (
            e.get("step")
            for e in run["events"]
            if e.get("event") == "first_step" and int(e.get("attempt", 0) or 0) == attempt
        ),
        None,
    )
    return isinstance(step, int) and isinstance(first, int) and first > step


def _heals(runs: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    heals: dict[tuple[str, Any], dict[str, Any]] = {}
    for run in runs:
        for e in run["events"]:
            if e.get("event") == "healed":
                key = (str(e.get("replica_id")), e.get("step"))
                heals.setdefault(
                    key,
                    {
                        "t": num(e.get("time")) - start,
                        "step": e.get("step"),
                        "replica_id": key[0],
                        "source": str(e.get("source")),
                        "bytes": int(num(e.get("bytes"))),
                        "seconds": num(e.get("seconds")),
                    },
                )
    return sorted(heals.values(), key=lambda h: h["t"])


_SAME_OUTAGE_S = 5.0
"""Slack when merging the groups' records of one outage: each group sees it from its own probes."""


def _lighthouse(runs: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """``{outages, lost, down_s, stall_s}``: the lighthouse's outages, each once, and its losses past
    ``lighthouse_wait``, merged from the groups' records by time."""

    def merged(name: str, begins: Any, ends: Any) -> list[dict[str, Any]]:
        records = sorted(
            (
                (begins(e), ends(e), run["replica_id"], e)
                for run in runs
                for e in run["events"]
                if e.get("event") == name
            ),
            key=lambda r: r[0],
        )
        out: list[dict[str, Any]] = []
        for begin, end, group, e in records:
            if not out or begin > out[-1]["_end"] + _SAME_OUTAGE_S:
                out.append({"t": begin - start, "step": e.get("step"), "by_group": {}, "_end": end})
            out[-1]["_end"] = max(out[-1]["_end"], end)
            out[-1]["by_group"][group] = e
        for o in out:
            del o["_end"]
        return out

    outages = []
    for o in merged(
        "lighthouse_outage",
        lambda e: num(e.get("down_since"), num(e.get("time")) - num(e.get("stall_s"))),
        lambda e: num(e.get("time")),
    ):
        by_group = o.pop("by_group")
        outages.append(
            o
            | {
                "down_s": max(num(e.get("down_s")) for e in by_group.values()),
                "stall_s": max(num(e.get("stall_s")) for e in by_group.values()),
                "stall_by_group": {g: num(e.get("stall_s")) for g, e in by_group.items()},
            }
        )
    lost = []
    for o in merged("lighthouse_lost", lambda e: num(e.get("time")), lambda e: num(e.get("time"))):
        by_group = o.pop("by_group")
        saved = [e.get("checkpoint_path") for e in by_group.values() if e.get("checkpoint_path")]
        lost.append(
            o
            | {
                "waited_s": max(num(e.get("waited_s")) for e in by_group.values()),
                "groups": sorted(by_group, key=_id_key),
                "checkpoint_path": saved[0] if saved else None,
            }
        )
    return {
        "outages": outages,
        "lost": lost,
        "down_s": sum(o["down_s"] for o in outages),
        "stall_s": sum(o["stall_s"] for o in outages),
    }


def _segments(run: dict[str, Any]) -> list[tuple[int, int, float]]:
    """``(first step, last step, seconds per step)`` from one run's ``progress`` records (rank 0), each attempt's
    first segment from the step its training started at (a heal's, a resume's, else 0)."""
    segments: list[tuple[int, int, float]] = []
    _, by_attempt = latest_run(run["events"])
    for evs in by_attempt.values():
        rank0 = [e for e in evs if e.get("rank", 0) == 0]
        healed = [e["step"] for e in rank0 if e.get("event") == "healed" and isinstance(e.get("step"), int)]
        began = [
            e["step"]
            for e in rank0
            if e.get("event") in ("replica_group", "resumed") and isinstance(e.get("step"), int)
        ]
        previous = healed[0] if healed else max(began, default=0)
        for e in rank0:
            if e.get("event") != "progress" or not isinstance(e.get("step"), int):
                continue
            if e["step"] > previous:
                segments.append((previous + 1, e["step"], num(e.get("productive_s")) / (e["step"] - previous)))
            previous = max(previous, e["step"])
    return segments


def _committed_step_time(runs: list[dict[str, Any]]) -> tuple[int, float]:
    """The steps the job trained (each once) and their time: for each step, the median of the seconds per step of
    the groups' segments that hold it."""
    segments = [s for run in runs for s in _segments(run)]
    bounds = sorted({s[0] for s in segments} | {s[1] + 1 for s in segments})
    steps, seconds = 0, 0.0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        rates = [rate for first, last, rate in segments if first <= lo and hi - 1 <= last]
        if rates:
            steps += hi - lo
            seconds += (hi - lo) * statistics.median(rates)
    return steps, seconds


def _group(run: dict[str, Any], summary: dict[str, Any], start: float) -> dict[str, Any]:
    """One group: its run, its attempts (steps, how each ended) and the single-run report's ETTR."""
    events = run["events"]
    attempts = []
    for a in summary["attempts"]:
        within = [e for e in events if int(e.get("attempt", 0) or 0) == a["attempt"]]
        evicted = next((e for e in within if e.get("event") == "node_evicted"), None)
        refused = any(e.get("event") == "join_refused" for e in within)
        gone = next((e for e in within if e.get("event") == "lighthouse_lost"), None)
        if evicted is not None:
            ended = f"evicted ({evicted.get('source')})"
        elif refused:
            ended = "refused to join (its node's cooldown)"
        elif gone is not None:
            ended = f"stopped: the lighthouse did not answer for {_s(num(gone.get('waited_s')))}"
        elif a["end_reason"] in ("unknown", "killed"):
            ended = "its log ends without a record (killed, or its node went away)"
        else:
            ended = a["end_reason"]
        first = next((e["step"] for e in within if e.get("event") == "first_step"), None)
        attempts.append(
            {
                "attempt": a["attempt"],
                "t_start": a["start_time"] - start,
                "t_end": a["end_time"] - start,
                "first_step": first,
                "last_step": a["last_step"],
                "ended": ended,
            }
        )
    replicas = summary["replicas"] or {}
    return {
        "replica_id": run["replica_id"],
        "folder": run["folder"],
        "run_id": run["run_id"],
        "group_size": run["group_size"],
        "attempts": attempts,
        "ettr": summary["ettr"],
        "heals": len([h for h in replicas.get("heals", []) if str(h["replica_id"]) == run["replica_id"]]),
    }


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def _bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover - the loop returns


def format_job_report(job: dict[str, Any]) -> str:
    """The text of :func:`summarize_job`'s summary."""
    ettr = "n/a" if job["ettr"] is None else f"{100 * job['ettr']:.1f}%"
    lines = [
        f"replica job (lighthouse {job['job']}): {len(job['groups'])} group run(s), wall {_s(job['wall_s'])},"
        f" effective training time {ettr} ({job['committed_steps']} committed steps, {_s(job['step_s'])} of steps"
        f" counted once, less {_s(job['discarded_s'])} of discarded steps)",
    ]
    live = ", ".join(f"{c['live_groups']} from t={_s(c['t'])} (step {c['step']})" for c in job["live_groups"])
    lines.append(f"  live groups: {live or 'no quorum recorded'}")
    lines.append(
        f"  failures: {len(job['failures'])} (stalls {_s(job['stall_s'])}, {job['discarded_steps']} discarded step(s))"
    )
    for f in job["failures"]:
        stalls = ", ".join(f"group {g} {_s(s)}" for g, s in sorted(f["stall_by_group"].items()))
        lines.append(
            f"    t={_s(f['t'])} step {f['step']}: group {f['replica_id']} {f['how']}"
            + (f" ({f['detail']})" if f["detail"] else "")
            + f"; stall {_s(f['stall_s'])} ({stalls}), {f['discarded_steps']} discarded step(s)"
        )
    lighthouse = job.get("lighthouse") or {"outages": [], "lost": []}
    if lighthouse["outages"] or lighthouse["lost"]:
        lines.append(
            f"  lighthouse: {len(lighthouse['outages'])} outage(s) lived through (down {_s(lighthouse['down_s'])},"
            f" quorums waited {_s(lighthouse['stall_s'])}, in the wall time), gone past lighthouse_wait"
            f" {len(lighthouse['lost'])} time(s)"
        )
        for o in lighthouse["outages"]:
            stalls = ", ".join(f"group {g} {_s(s)}" for g, s in sorted(o["stall_by_group"].items()))
            lines.append(
                f"    t={_s(o['t'])} step {o['step']}: down {_s(o['down_s'])}; stall {_s(o['stall_s'])} ({stalls})"
            )
        for o in lighthouse["lost"]:
            saved = f", {o['checkpoint_path']} committed" if o["checkpoint_path"] else ", no checkpoint"
            lines.append(
                f"    t={_s(o['t'])} step {o['step']}: did not answer for {_s(o['waited_s'])}; groups"
                f" {', '.join(o['groups'])} stopped{saved}"
            )
    total = sum(h["bytes"] for h in job["heals"])
    lines.append(f"  heals: {len(job['heals'])} ({_bytes(total)} from live groups)")
    for h in job["heals"]:
        lines.append(
            f"    t={_s(h['t'])} step {h['step']}: group {h['replica_id']} from group {h['source']},"
            f" {_bytes(h['bytes'])} in {_s(h['seconds'])}"
        )
    lines.append("  groups:")
    for g in job["groups"]:
        g_ettr = "n/a" if g["ettr"] is None else f"{100 * g['ettr']:.1f}%"
        lines.append(f"    group {g['replica_id']} (run {g['run_id']}, {g['folder']}): ETTR {g_ettr} of its own run")
        for a in g["attempts"]:
            steps = "no step trained" if a["first_step"] is None else f"steps {a['first_step']}..{a['last_step']}"
            lines.append(f"      attempt {a['attempt']}: t={_s(a['t_start'])}..{_s(a['t_end'])}, {steps}, {a['ended']}")
    return "\n".join(lines)
