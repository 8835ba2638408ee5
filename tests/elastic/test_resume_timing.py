"""The time a world change cost, in parts, from the run's own event records."""

from __future__ import annotations

import pytest

from lightning_ft.elastic.resume_timing import previous_world, resume_timing


def ev(event, attempt, time, run_id="r", **fields):
    return {"event": event, "attempt": attempt, "time": time, "run_id": run_id, **fields}


def test_the_breakdown_runs_from_the_previous_worlds_last_step_to_the_first_step_here():
    events = [
        ev("progress", 0, 90.0),
        ev("attempt_end", 0, 104.0, rank=1, last_step_time=100.0),
        ev("attempt_end", 0, 103.0, rank=2, last_step_time=101.0),
        ev("progress", 0, 500.0, run_id="another run"),
        ev("attempt_start", 1, 110.0),
    ]
    previous = previous_world(events, run_id="r", attempt=1)
    assert (previous.attempt, previous.last_step_time, previous.stop_time) == (0, 101.0, 103.0)
    timing = resume_timing(
        previous, process_start_time=108.0, load_start_time=115.0, load_end_time=117.5, first_step_time=119.0
    )
    assert timing == pytest.approx(
        {
            "detection_s": 2.0,
            "rendezvous_s": 5.0,
            "startup_s": 7.0,
            "load_s": 2.5,
            "first_step_s": 1.5,
            "downtime_s": 18.0,
        }
    )
    assert sum(v for k, v in timing.items() if k != "downtime_s") == pytest.approx(timing["downtime_s"])


def test_a_progress_line_written_after_its_step_counts_from_the_step_s_end():
    # The hang watchdog writes the progress of the last steps when it fires, 30 s after the step ended at 60.
    events = [ev("progress", 2, 50.0), ev("progress", 2, 90.0, last_step_time=60.0), ev("attempt_start", 3, 95.0)]
    assert previous_world(events, run_id="r", attempt=3).last_step_time == 60.0


def test_without_attempt_end_records_the_clock_starts_at_the_last_progress_and_detection_is_unknown():
    events = [ev("progress", 2, 50.0), ev("progress", 2, 60.0), ev("attempt_start", 3, 70.0)]
    previous = previous_world(events, run_id="r", attempt=4)  # attempt 3 never trained: 2 is the previous world
    assert (previous.attempt, previous.last_step_time, previous.stop_time) == (2, 60.0, None)
    timing = resume_timing(
        previous, process_start_time=80.0, load_start_time=85, load_end_time=86, first_step_time=None
    )
    assert timing["detection_s"] is None and timing["rendezvous_s"] is None and timing["first_step_s"] is None
    assert timing["load_s"] == 1.0
