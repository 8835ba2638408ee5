"""What replica groups cost a run: the survivors' stalls, the discarded steps, the heals, the live groups per step.

In the replica mode (docs/replica-groups.md) a failure restarts no attempt: the surviving groups stall for a few
seconds, discard the step that saw it, and go on; a replacement group heals from a live peer. The strategy records
these as events (docs/replica-groups-reference.md, "Events and metrics"):

- ``replica_lost {replica_id, step, stall_s, discarded_steps}``: a group left the quorum; the survivors waited
  ``stall_s`` seconds, within their training steps, from the failure to their next committed step, and discarded
  ``discarded_steps`` steps;
- ``replica_joined {replica_id, step}``: a group joined the quorum;
- ``healed {replica_id, source, bytes, seconds, step}``: the joining group ``replica_id`` copied ``bytes`` of live
  state from group ``source`` in ``seconds``;
- ``replica_quorum {step, live_groups}``: the quorum of ``step`` has ``live_groups`` groups;
- ``lighthouse_outage {step, lighthouse, down_s, stall_s, down_since}``: the lighthouse did not answer for ``down_s``
  seconds (first unanswered probe to the first answered one, from ``down_since``, Unix seconds) and the quorum of
  ``step`` waited ``stall_s`` seconds in all;
- ``lighthouse_lost {step, lighthouse, waited_s, checkpoint_path}``: it did not answer for ``lighthouse_wait``; the
  group stopped (after committing ``checkpoint_path``, on the writing group).

Every rank of every group may write the same event: :func:`replica_summary` keeps one per group and step (the
longest stall, the largest count), so the totals count each failure once. Of a stall, the wait for the next quorum
lies before a batch's start hook, outside the productive time (so the ETTR, productive time over wall time, already
pays it); what the loss wasted of the productive time is the discarded steps' compute (:func:`discarded_seconds`:
the report's ``lost_s`` includes it, the ETTR leaves it out of the useful time). A lighthouse outage's stall is a
quorum's wait too: the wall time holds it, nothing is subtracted for it. A heal is the joining group's recovery, which
the survivors do not wait for. :class:`ReplicaTally` keeps the same totals live for
:class:`~lightning_ft.monitors.GoodputMonitor`, from the lines its rank appends to the event log.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_ft.monitors.run_history import num

__all__ = ["REPLICA_EVENTS", "ReplicaTally", "discarded_seconds", "read_new_lines", "replica_summary"]

REPLICA_EVENTS = (
    "replica_lost",
    "replica_joined",
    "healed",
    "replica_quorum",
    "lighthouse_outage",
    "lighthouse_lost",
)
"""The events of the replica mode this module reads."""

_KEPT = {
    "replica_lost": ("stall_s", "discarded_steps"),
    "replica_joined": (),
    "healed": ("source", "bytes", "seconds"),
    "lighthouse_outage": ("lighthouse", "down_s", "stall_s", "down_since"),
    "lighthouse_lost": ("lighthouse", "waited_s", "checkpoint_path"),
}
"""Per event, the fields a summary keeps besides ``time``, ``step``, ``attempt`` and ``replica_id``."""


def _merged(events: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """One record per ``(replica_id, step)`` of event ``name``, at the earliest time, with the largest numbers."""
    out: dict[tuple[str, Any], dict[str, Any]] = {}
    for e in sorted((e for e in events if e.get("event") == name), key=lambda e: num(e.get("time"))):
        key = (str(e.get("replica_id")), e.get("step"))
        if name.startswith("lighthouse_"):  # the group's own: one per attempt and step
            key = (str(e.get("attempt")), e.get("step"))
        record = out.setdefault(
            key, {k: e.get(k) for k in ("time", "step", "attempt", "replica_id")} | {k: None for k in _KEPT[name]}
        )
        for field in _KEPT[name]:
            value = e.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                record[field] = value if record[field] is None else max(record[field], value)
            elif record[field] is None:
                record[field] = value
    return list(out.values())


def _live_groups(events: Iterable[dict[str, Any]]) -> list[list[int]]:
    """``[step, live_groups]`` at each step where the number of live groups changed, in step order."""
    by_step: dict[int, int] = {}
    for e in sorted((e for e in events if e.get("event") == "replica_quorum"), key=lambda e: num(e.get("time"))):
        if isinstance(e.get("step"), int) and isinstance(e.get("live_groups"), int):
            by_step[e["step"]] = e["live_groups"]
    changes: list[list[int]] = []
    for step in sorted(by_step):
        if not changes or changes[-1][1] != by_step[step]:
            changes.append([step, by_step[step]])
    return changes


def replica_summary(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The replica events of a run, one per group and step, with their totals; ``None`` when there are none.

    Keys: ``lost``, ``joined``, ``heals`` (the merged records, in time order), ``live_groups`` (``[step, n]`` where
    the number changed), ``stall_s`` (the survivors' stalls), ``discarded_steps``, ``heal_s`` and ``heal_bytes``
    (the heals' seconds and bytes), ``replicas_lost``, ``replicas_joined``, ``min_live_groups`` and
    ``last_live_groups`` (``None`` without ``replica_quorum`` events), ``lighthouse_outages`` and ``lighthouse_lost``
    (the merged records), ``lighthouse_down_s`` and ``lighthouse_stall_s`` (the outages' totals).
    """
    events = [e for e in events if e.get("event") in REPLICA_EVENTS]
    if not events:
        return None
    lost, joined, heals, outages, gone = (
        _merged(events, name)
        for name in ("replica_lost", "replica_joined", "healed", "lighthouse_outage", "lighthouse_lost")
    )
    live = _live_groups(events)
    return {
        "lost": lost,
        "joined": joined,
        "heals": heals,
        "live_groups": live,
        "stall_s": sum(num(r["stall_s"]) for r in lost),
        "discarded_steps": int(sum(num(r["discarded_steps"]) for r in lost)),
        "heal_s": sum(num(r["seconds"]) for r in heals),
        "heal_bytes": int(sum(num(r["bytes"]) for r in heals)),
        "replicas_lost": len(lost),
        "replicas_joined": len(joined),
        "min_live_groups": min((n for _, n in live), default=None),
        "last_live_groups": live[-1][1] if live else None,
        "lighthouse_outages": outages,
        "lighthouse_lost": gone,
        "lighthouse_down_s": sum(num(r["down_s"]) for r in outages),
        "lighthouse_stall_s": sum(num(r["stall_s"]) for r in outages),
    }


def discarded_seconds(discarded_steps: float, productive_s: float, committed_steps: float) -> float:
    """The productive seconds that ``discarded_steps`` discarded steps took, of ``productive_s`` spent on them and on
    ``committed_steps`` committed ones (each step the same share: the discarded one ran the same forward and
    backward)."""
    steps = max(discarded_steps, 0.0) + max(committed_steps, 0.0)
    return productive_s * max(discarded_steps, 0.0) / steps if steps > 0 else 0.0


def read_new_lines(path: str | Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of ``path`` from byte ``offset`` on, and the offset after the last complete one.

    A line still being written (no newline yet) is left for the next call; a file that does not exist yet has none.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = []
    for raw in data[:end].splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue  # a torn line of a killed writer: the report skips it too
    return lines, offset + end


class ReplicaTally:
    """The replica totals of one attempt so far, fed with its event lines as they are written.

    Example::

        tally = ReplicaTally(run_id="r", attempt=1)
        tally.add([{"event": "replica_lost", "run_id": "r", "attempt": 1, "replica_id": "g2", "step": 40,
                    "stall_s": 1.3, "discarded_steps": 1}])
        tally.stall_s  # 1.3
    """

    def __init__(self, *, run_id: str, attempt: int) -> None:
        self.run_id, self.attempt = run_id, attempt
        self._events: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        """:func:`replica_summary` of the lines added so far."""

    def add(self, lines: Iterable[dict[str, Any]]) -> None:
        """Add event lines; those of other runs or attempts and other events are ignored."""
        new = [
            e
            for e in lines
            if e.get("event") in REPLICA_EVENTS and e.get("run_id") == self.run_id and e.get("attempt") == self.attempt
        ]
        if new:
            self._events += new
            self.summary = replica_summary(self._events)

    def total(self, key: str) -> float:
        """A total of :func:`replica_summary` (0 before any replica event)."""
        return float(self.summary[key]) if self.summary is not None else 0.0

    @property
    def stall_s(self) -> float:
        return self.total("stall_s")

    @property
    def live_groups(self) -> int | None:
        """The live groups of the latest quorum recorded, ``None`` before the first."""
        return self.summary["last_live_groups"] if self.summary is not None else None
