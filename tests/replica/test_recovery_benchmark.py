"""benchmarks/replica_recovery.py's metrics on synthetic step records whose answers are known by construction."""

from __future__ import annotations

import pytest

from benchmarks.replica_recovery import (
    ettr,
    fault_schedule,
    mean_step_time,
    new_samples_rate,
    outage_throughput,
    stall_per_failure,
    stalls,
    start_to_commit,
    step_at,
    step_time,
    table,
)

STEP = 0.5


def _restart_run() -> tuple[list[dict], float]:
    """One job: steps 1..40 every 0.5 s (t = 0.5 .. 20); killed at t = 20.2 after step 40; the restart's first
    step (step 36 again: the checkpoint was at 35) at t = 30; it reaches step 41 (new) at t = 32.5; then on to 60."""
    records = [{"step": s, "time": s * STEP, "pid": 1, "samples": 24} for s in range(1, 41)]
    records += [{"step": s, "time": 30 + (s - 36) * STEP, "pid": 2, "samples": 24} for s in range(36, 61)]
    return records, 20.2


def _replica_run() -> tuple[list[dict], float, float]:
    """Three groups step together every 0.5 s (steps 1..40, t = 0.5..20); group 2 is killed at t = 20.2; groups 0
    and 1 discard the step in flight and commit step 41 at t = 22.0 (1 s late), then go on every 0.5 s; group 2's
    replacement commits its first step (step 51) at t = 27.0."""
    records = []
    for g in range(3):
        records += [{"step": s, "time": s * STEP, "pid": 10 + g, "samples": 8} for s in range(1, 41)]
    for g in range(2):
        records += [{"step": s, "time": 22.0 + (s - 41) * STEP, "pid": 10 + g, "samples": 8} for s in range(41, 61)]
    records += [{"step": s, "time": 22.0 + (s - 41) * STEP, "pid": 99, "samples": 8} for s in range(51, 61)]
    return records, 20.2, 27.0


def test_step_time_is_the_median_gap_between_a_process_s_consecutive_steps() -> None:
    records, _ = _restart_run()
    assert step_time(records) == pytest.approx(STEP)  # the 10 s gap of the restart is another pid: not a step


def test_restart_metrics() -> None:
    records, kill = _restart_run()
    assert step_at(records, 25.0) == 40 and step_at(records, 31.0) == 38  # the restart went back to step 36
    merged = stalls(records, [kill], STEP)
    # Progress stopped from step 40 (t = 20) to step 41 (t = 32.5): 12.5 s, one of which a step would have taken.
    assert len(merged) == 1 and merged[0]["stall_s"] == pytest.approx(12.0)
    assert stall_per_failure(merged) == [pytest.approx(12.0)]
    # Window 0..40 s: at t = 40 the run is at step 56 (30 + 20 * 0.5 = 40): 56 steps of 0.5 s in 40 s.
    assert ettr(records, 0.0, 40.0, STEP) == pytest.approx(56 * STEP / 40)
    # During the outage (kill .. step 41) no new step: the recomputed steps 36..40 are no progress.
    out = outage_throughput(records, kill, 32.5, before_s=10.0)
    assert out["during"] == 0.0 and out["before"] == pytest.approx(20 * 24 / 10.0)


def test_replica_metrics() -> None:
    records, kill, back = _replica_run()
    assert step_time(records) == pytest.approx(STEP)
    merged = stalls(records, [kill], STEP)
    assert merged[0]["stall_s"] == pytest.approx(22.0 - 20.0 - STEP)
    # Two groups of 8 samples per 0.5 s while group 2 is out (steps 42..50 at 22.5 .. 26.5, and 41 at 22.0).
    assert new_samples_rate(records, kill, back) == pytest.approx(10 * 2 * 8 / (back - kill))
    out = outage_throughput(records, kill, back, before_s=10.0)
    assert out["before"] == pytest.approx(3 * 8 / STEP) and out["ratio"] == pytest.approx(out["during"] / out["before"])


def test_with_the_mean_fault_free_step_a_run_without_a_failure_scores_one_and_a_stall_is_left_out_of_the_mean() -> None:
    """Steps that jitter (0.4 s, 0.4 s, 0.7 s in turn): the median step (0.4 s) gives a run without a failure 0.4 / 0.5
    of its window, the mean (0.5 s) the whole of it. A stall's gap is not a fault-free step."""
    times, t = [], 0.0
    for s in range(1, 101):
        t += 0.7 if s % 3 == 0 else 0.4
        times.append(t)
    records = [{"step": s, "time": times[s - 1], "pid": 1, "samples": 8} for s in range(1, 101)]
    window = (times[0], times[-1])
    assert ettr(records, *window, step_time(records)) == pytest.approx(0.4 / 0.5, rel=0.01)
    assert mean_step_time(records, []) == pytest.approx(0.5, rel=0.01)
    assert ettr(records, *window, mean_step_time(records, [])) == pytest.approx(1.0, rel=0.01)
    replica, kill, _ = _replica_run()
    assert mean_step_time(replica, stalls(replica, [kill], STEP)) == pytest.approx(STEP)  # the 2 s gap left out


def test_a_lighthouse_restart_s_stall_is_found_after_the_steps_in_flight() -> None:
    """The lighthouse dies at t = 10.1; the groups commit steps 21 and 22 (t = 10.5, 11.0), then wait 2.5 s at the
    next quorum (step 23 at t = 13.5): a stall of 2.5 - 0.5 s, which the first commit after the kill does not show."""
    times = [s * STEP for s in range(1, 23)] + [13.5 + (s - 23) * STEP for s in range(23, 40)]
    records = [{"step": s, "time": t, "pid": 1, "samples": 8} for s, t in zip(range(1, 40), times, strict=True)]
    assert stalls(records, [10.1], STEP)[0]["stall_s"] == pytest.approx(0.0)
    (merged,) = stalls(records, [10.1], STEP, later={10.1: 12.0})
    assert merged["stall_s"] == pytest.approx(2.0) and merged["start"] == pytest.approx(11.0)


def test_overlapping_stalls_are_counted_once_and_split() -> None:
    records, kill = _restart_run()
    merged = stalls(records, [kill, 25.0], STEP)  # a second kill during the restart: one stall, two failures
    assert len(merged) == 1 and merged[0]["kills"] == [kill, 25.0]
    assert stall_per_failure(merged) == [pytest.approx(6.0), pytest.approx(6.0)]


def test_start_to_commit_splits_the_way_to_the_first_step() -> None:
    start = {"process_start": 103.0, "imported": 113.0}
    parts = start_to_commit(100.0, start, 120.0, heal_s=0.5)
    assert parts == {"launcher": 3.0, "imports": 10.0, "setup": 6.5, "heal": 0.5, "total": 20.0}
    assert parts["launcher"] + parts["imports"] + parts["setup"] + parts["heal"] == parts["total"]


def test_fault_schedule_is_seeded_and_within_the_gaps() -> None:
    a = fault_schedule(3, 600, 30, 60, 3)
    assert a == fault_schedule(3, 600, 30, 60, 3) and a != fault_schedule(4, 600, 30, 60, 3)
    times = [0.0] + [t for t, _ in a]
    assert all(30 <= b - t <= 60 for t, b in zip(times, times[1:], strict=False)) and times[-1] < 600
    assert 600 / 60 - 1 <= len(a) <= 600 / 30 and {v for _, v in a} <= {0, 1, 2}
    with pytest.raises(ValueError, match="min_gap"):
        fault_schedule(0, 600, 60, 30, 3)


def test_table_has_a_column_per_mode() -> None:
    records, kill = _restart_run()
    merged = stalls(records, [kill], STEP)
    result = {
        "mode": "restart",
        "kills": [{"time": kill}],
        "window_s": 40.0,
        "step_s": STEP,
        "steps": 56,
        "ettr": 0.7,
        "report_ettr": 0.6,
        "stall_per_failure": stall_per_failure(merged),
        "recoveries": [start_to_commit(100.0, {"process_start": 103.0, "imported": 113.0}, 120.0, 0.0)],
        "outages": [outage_throughput(records, kill, 32.5, before_s=10.0)],
    }
    text = table([result, result | {"mode": "replica"}])
    assert text.splitlines()[0] == "| | restart | replica |"
    assert "| stall per failure (s) | 12.00 | 12.00 |" in text
