"""Restart time of every incident of a run, broken into detection, exit, relaunch, set-up, load and first step.

Reads a run's event logs (``<default_root_dir>``) and, for every attempt that a later attempt follows, prints:

- fault: ``preempted`` (the first signal on any rank: ``signal_time``), ``hang`` (the last progress point of the rank
  that stopped first: ``last_progress_time``), ``kill``/``crash`` (the ``fault_injected`` event, else the last
  ``attempt_end``);
- detection: fault -> the ranks agreed to stop (``preempted.agreed_time``), the watchdog fired (``hang``), or a
  surviving rank ended its attempt (``attempt_end``, a kill);
- exit: detection -> the last ``attempt_end`` of the attempt (a preemption commits its checkpoint here);
- relaunch: -> the next attempt's first ``attempt_start`` (torchrun's restart, interpreter start and imports,
  rendezvous, process group);
- setup: -> the start of the load (``process_start_time + resumed.startup_s``: model set-up, health checks);
- load: ``resumed.load_s``; first step: the load's end -> ``first_step``;
- recomputed: steps completed before the fault that the next attempt trains again.

Run: ``python benchmarks/restart_breakdown.py RUN_ROOT`` (e.g. the demo's ``demo_run``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_ft.events import read_events


def _first(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in events if e["event"] == name), None)


def incident(attempt: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The breakdown of one incident: ``attempt``'s events, ``after`` the next attempt's. ``None`` without a resume."""
    resumed, first_step = _first(after, "resumed"), _first(after, "first_step")
    starts = [e["time"] for e in after if e["event"] == "attempt_start"]
    if resumed is None or first_step is None or not starts:
        return None
    ends = [e for e in attempt if e["event"] == "attempt_end"]
    if ends and all(e["reason"] == "finished" for e in ends):
        return None  # a relaunch after a finished run, not an incident
    preempted = [e for e in attempt if e["event"] == "preempted" and e.get("agreed_time")]
    hangs = [e for e in attempt if e["event"] == "hang"]
    injected = _first(attempt, "fault_injected")
    if preempted:
        kind = f"preemption ({preempted[0]['signal']})"
        fault = min(e["signal_time"] for e in preempted)
        detected = min(e["agreed_time"] for e in preempted)
        reached = max(e["step"] for e in preempted)
    elif hangs:
        kind = "hang"
        fault = min(e["last_progress_time"] for e in hangs if e.get("last_progress_time"))
        detected = min(e["time"] for e in hangs)
        culprit = hangs[0]["heartbeats"][str(hangs[0]["first_rank"])]
        reached = culprit["step"]
    else:
        killed = injected is not None and injected["kind"] == "kill_at"
        kind = "kill (SIGKILL)" if killed else "crash"
        fault = injected["time"] if injected else min((e["time"] for e in ends), default=None)
        detected = min((e["time"] for e in ends), default=starts[0])
        # A killed rank dies in the step after the one it had completed; a crash is recorded where it happened.
        reached = injected["step"] if killed else max((e["step"] or 0) for e in attempt)
    if fault is None:
        return None
    exited = max((e["time"] for e in ends), default=detected)
    start = _first(after, "attempt_start")
    if "startup_s" in resumed and start is not None and start.get("process_start_time"):
        # lightning-ft 0.2 writes `resumed` once the first step is done, with the load's own times.
        load_start = start["process_start_time"] + resumed["startup_s"]
        load_end = load_start + resumed.get("load_s", 0.0)
    else:
        load_start = resumed["time"] - resumed.get("load_s", 0.0)
        load_end = resumed["time"]
    return {
        "attempt": attempt[0]["attempt"],
        "kind": kind,
        "detection_s": detected - fault,
        "exit_s": max(exited - detected, 0.0),
        "relaunch_s": min(starts) - max(exited, detected),
        "setup_s": load_start - min(starts),
        "load_s": resumed.get("load_s", 0.0),
        "first_step_s": first_step["time"] - load_end,
        "total_s": first_step["time"] - fault,
        "recomputed_steps": max(int(reached or 0) - int(resumed["step"] or 0), 0),
    }


def breakdown(root: str) -> list[dict[str, Any]]:
    events = read_events(root)
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        by_attempt.setdefault(int(e["attempt"]), []).append(e)
    rows = []
    for a in sorted(by_attempt):
        if a + 1 in by_attempt:
            row = incident(by_attempt[a], by_attempt[a + 1])
            if row is not None:
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    args = parser.parse_args()
    columns = ("detection_s", "exit_s", "relaunch_s", "setup_s", "load_s", "first_step_s", "total_s")
    print(f"{'attempt':>7} {'incident':<22}" + "".join(f"{c.removesuffix('_s'):>11}" for c in columns) + " recomputed")
    for row in breakdown(args.root):
        cells = "".join(f"{row[c]:>10.2f}s" for c in columns)
        print(f"{row['attempt']:>7} {row['kind']:<22}{cells} {row['recomputed_steps']:>10}")


if __name__ == "__main__":
    main()
