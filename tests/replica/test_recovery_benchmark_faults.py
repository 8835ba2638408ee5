"""benchmarks/replica_recovery.py's kinds of failure (SIGKILL, hang, lighthouse restart): drawn seeded, and each
stall attributed to its kind, on synthetic records whose answers are known by construction."""

from __future__ import annotations

import pytest

from benchmarks.replica_recovery import (
    FAULT_KINDS,
    _event_stalls_by_kind,
    fault_kinds,
    fault_schedule,
    stalls,
    stalls_by_kind,
    table,
)


def test_fault_kinds_are_seeded_cover_each_kind_and_leave_the_schedule_alone():
    times = fault_schedule(3, 600, 30, 60, 3)
    kinds = fault_kinds(3, len(times), ["sigkill", "hang", "lighthouse"])
    assert kinds == fault_kinds(3, len(times), ["sigkill", "hang", "lighthouse"]) and len(kinds) == len(times)
    assert set(kinds) == {"sigkill", "hang", "lighthouse"}
    assert fault_schedule(3, 600, 30, 60, 3) == times  # the times and victims do not depend on the kinds
    assert fault_kinds(0, 4, ["sigkill"]) == ["sigkill"] * 4
    with pytest.raises(ValueError, match="kinds"):
        fault_kinds(0, 3, ["reboot"])


def test_each_stall_is_counted_under_the_kind_of_its_fault():
    step = 0.5
    # Commits every 0.5 s; a SIGKILL at t = 10.2 costs 1.5 s (next commit at 12.0), a hang at t = 20.2 costs 6 s.
    records = [{"step": s, "time": s * step, "pid": 1, "samples": 8} for s in range(1, 21)]
    records += [{"step": 21 + i, "time": 12.0 + i * step, "pid": 1, "samples": 8} for i in range(17)]
    records += [{"step": 38 + i, "time": 26.5 + i * step, "pid": 1, "samples": 8} for i in range(10)]
    merged = stalls(records, [10.2, 20.2], step)
    by_kind = stalls_by_kind(merged, {10.2: "sigkill", 20.2: "hang"})
    assert by_kind == {"sigkill": [pytest.approx(1.5)], "hang": [pytest.approx(6.0)]}


def test_the_survivors_stall_of_each_group_fault_is_the_first_loss_of_its_victim_after_it():
    lost = [
        {"time": 12.0, "replica_id": "2", "stall_s": 1.2},
        {"time": 31.0, "replica_id": "1", "stall_s": 6.1},
        {"time": 50.0, "replica_id": "2", "stall_s": 1.1},
    ]
    kills = [
        {"time": 10.0, "victim": 2, "kind": "sigkill", "name": "g2"},
        {"time": 20.0, "victim": 1, "kind": "hang", "name": "g1"},
        {"time": 40.0, "victim": 0, "kind": "lighthouse", "name": None},
        {"time": 45.0, "victim": 2, "kind": "sigkill", "name": "g2.1"},
    ]
    assert _event_stalls_by_kind(lost, kills) == {"sigkill": [1.2, 1.1], "hang": [6.1]}


def test_the_table_has_a_row_per_kind():
    result = {
        "mode": "replica",
        "kills": [{"time": 1.0, "kind": "sigkill"}, {"time": 2.0, "kind": "hang"}],
        "window_s": 60.0,
        "step_s": 0.5,
        "steps": 100,
        "ettr": 0.9,
        "stall_per_failure": [1.0, 6.0],
        "stall_by_kind": {"sigkill": [1.0], "hang": [6.0]},
        "event_stalls": [1.1, 6.1],
        "event_stalls_by_kind": {"sigkill": [1.1], "hang": [6.1]},
        "recoveries": [],
        "outages": [],
    }
    text = table([result])
    assert "| failures in the window | 2 (1 sigkill, 1 hang) |" in text
    assert "|   per sigkill (s) | 1.00 |" in text and "|   per hang (s) | 6.00 |" in text
    assert "|   per lighthouse (s) | - |" in text and len(FAULT_KINDS) == 3
