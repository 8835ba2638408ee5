from __future__ import annotations

import pytest

from lightning_ft.monitors.goodput_report import format_report, plot_timeline, summarize


def _e(time, attempt, rank, event, step, **fields):
    return {"time": time, "run_id": "r1", "attempt": attempt, "rank": rank, "event": event, "step": step, **fields}


def two_attempts_with_a_preemption() -> list[dict]:
    """Attempt 0 (2 ranks) trains to step 33 and is preempted; attempt 1 resumes from the step-20 checkpoint."""
    return [
        _e(1000, 0, 0, "attempt_start", None, world_size=2, process_start_time=990.0),
        _e(1001, 0, 1, "attempt_start", None, world_size=2, process_start_time=991.0),
        _e(1010, 0, 0, "first_step", 1, since_attempt_start_s=20.0),
        _e(1020, 0, 0, "progress", 10, productive_s=8.0, data_wait_s=1.0),
        _e(1030, 0, 0, "progress", 20, productive_s=8.0, data_wait_s=1.0),
        _e(1031, 0, 0, "checkpoint_committed", 20, path="ckpt/step=20", stall_s=0.5, total_s=3.0, size_bytes=10),
        _e(1035, 0, 0, "straggler", 25, suspect_rank=1, ratio=1.3, onset_step=17),
        _e(1040, 0, 0, "progress", 30, productive_s=8.0, data_wait_s=1.0),
        _e(1043, 0, 0, "preempted", 33, signal="SIGTERM"),
        _e(1043, 0, 1, "preempted", 33, signal="SIGTERM"),
        _e(1060, 1, 0, "attempt_start", None, world_size=2, process_start_time=1050.0),
        _e(1060, 1, 1, "attempt_start", None, world_size=2, process_start_time=1050.0),
        _e(1065, 1, 0, "resumed", 20, path="ckpt/step=20", saved_world_size=2, world_size=2),
        _e(1070, 1, 0, "first_step", 21, since_attempt_start_s=20.0),
        _e(1078, 1, 0, "progress", 30, productive_s=7.0, data_wait_s=1.0),
        _e(1088, 1, 0, "progress", 40, productive_s=8.0, data_wait_s=1.0),
        _e(1090, 1, 0, "straggler_cleared", 40, suspect_rank=1, lost_s=2.0, recovered=False),
    ]


def test_summary_of_two_attempts_matches_the_hand_computed_numbers():
    s = summarize(two_attempts_with_a_preemption())
    t = s["totals"]
    # Walls: attempt 0 from process start 990 to its last event 1043 (53 s); attempt 1 from 1050 to 1090 (40 s).
    assert [a["wall_s"] for a in s["attempts"]] == [53.0, 40.0]
    assert t["wall_s"] == 93.0
    assert t["productive_s"] == 39.0  # 8 + 8 + 8 + 7 + 8
    assert t["data_wait_s"] == 5.0
    assert t["checkpoint_stall_s"] == 0.5
    # Restart: last progress of attempt 0 (1040) to the first step of attempt 1 (1070); recovery from 1050.
    (restart,) = s["restarts"]
    assert restart["restart_s"] == 30.0
    assert restart["recovery_s"] == 20.0
    assert restart["cause"] == "preempted"
    # Lost work: attempt 0 reached step 33, attempt 1 resumed at 20; the progress interval (20, 30] took 8 s.
    assert restart["lost_steps"] == 13
    assert restart["lost_s"] == 8.0
    # ETTR: (39 - 8) useful seconds over 93 wall seconds.
    assert s["ettr"] == pytest.approx(31 / 93)
    # Device time held: 2 devices x (53 + 7 s gap + 40); useful: 2 x (16 + 15).
    assert t["device_s_held"] == 200.0
    assert s["device_utilisation"] == pytest.approx(62 / 200)
    assert s["stragglers"]["count"] == 1
    assert s["stragglers"]["detections"][0]["latency_steps"] == 8
    assert t["straggler_s"] == 2.0
    assert {i["event"] for i in s["incidents"]} == {"preempted", "straggler"}


def test_a_restart_without_a_resumed_event_loses_every_step_of_the_failed_attempt():
    events = [e for e in two_attempts_with_a_preemption() if e["event"] != "resumed"]
    (restart,) = summarize(events)["restarts"]
    assert restart["resumed_step"] == 0
    assert restart["lost_steps"] == 33
    assert restart["lost_s"] == 24.0


def test_the_report_names_the_ratios_and_the_restart():
    text = format_report(summarize(two_attempts_with_a_preemption()))
    assert "effective training time ratio  33.3%" in text
    assert "restart before attempt 1: 30.0s (recovery 20.0s)" in text
    assert "lost 13 steps" in text
    assert "rank 1 1.30x" in text


def test_only_the_latest_run_in_a_shared_log_is_summarized():
    other = [dict(e, run_id="old", time=e["time"] - 5000) for e in two_attempts_with_a_preemption()]
    s = summarize(other + two_attempts_with_a_preemption()[:10])
    assert s["run_id"] == "r1"
    assert s["totals"]["attempts"] == 1


def test_an_empty_log_gives_an_empty_summary():
    s = summarize([])
    assert s["ettr"] is None
    assert s["totals"]["attempts"] == 0
    assert "0 attempt(s)" in format_report(s)


def test_the_timeline_is_written_as_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    plot_timeline(two_attempts_with_a_preemption(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
