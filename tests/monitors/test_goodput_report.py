"""The report on recorded run histories of every kind (hand-written event logs under ``histories/``).

Every number asserted here is computed by hand from the fixture's lines; the comments show the arithmetic.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.monitors.goodput_report import plot_timeline, summarize, timeline_figure
from lightning_ft.monitors.goodput_text import format_report
from lightning_ft.monitors.run_history import highest_step

HISTORIES = Path(__file__).parent / "histories"


def history(name: str) -> list[dict]:
    return read_events(HISTORIES / name)


def report(name: str, **kwargs) -> dict:
    return summarize(history(name), **kwargs)


def phases(restart: dict) -> tuple:
    return tuple(restart[k] for k in ("detection_s", "exit_s", "relaunch_s", "startup_s", "load_s", "first_step_s"))


def test_a_finished_run_says_so_and_suggests_an_interval_for_an_assumed_mtbf():
    s = report("finished")
    (attempt,) = s["attempts"]
    assert attempt["end_reason"] == "finished"
    assert s["restarts"] == [] and s["continuations"] == []
    # Wall: process start 1000 to rank 0's attempt_end at 1062; productive 4 x 8 s.
    assert s["totals"]["wall_s"] == 62.0
    assert s["ettr"] == pytest.approx(32 / 62)
    assert s["device_utilisation"] == pytest.approx(32 / 62)
    ci = s["checkpoint_interval"]
    # C = median(0.5, 0.7) s; no failure, so 24 h is assumed; one step takes (32 + 4) s / 40 steps.
    assert (ci["stall_s"], ci["total_s"], ci["mtbf_source"]) == (pytest.approx(0.6), pytest.approx(2.25), "assumed")
    assert ci["interval_s"] == pytest.approx(math.sqrt(2 * 0.6 * 24 * 3600))
    assert ci["interval_steps"] == round(math.sqrt(2 * 0.6 * 24 * 3600) / 0.9)
    assert ci["current_interval_steps"] == 20
    text = format_report(s)
    assert "ended: finished" in text
    assert "no failure observed; MTBF assumed 24.0h (--mtbf-hours to change)" in text


def test_launching_a_finished_run_again_is_a_continuation_not_a_restart():
    s = report("continued")
    assert [a["end_reason"] for a in s["attempts"]] == ["finished", "finished"]
    assert s["restarts"] == []
    (cont,) = s["continuations"]
    # Attempt 0 ended at 1062, attempt 1's processes started at 260000: three days the run was not running.
    assert (cont["attempt"], cont["gap_s"]) == (1, 260000.0 - 1062.0)
    t = s["totals"]
    assert (t["restarts"], t["continuations"], t["lost_steps"], t["restart_s"]) == (0, 1, 0, 0.0)
    # The gap is neither wall time nor device time held: 62 + 52 s wall, 2 x 114 device-s held.
    assert t["wall_s"] == 114.0
    assert t["device_s_held"] == 228.0
    assert s["ettr"] == pytest.approx(64 / 114)
    assert s["device_utilisation"] == pytest.approx(64 / 114)
    assert "attempt 1 continues finished attempt 0: gap 71.9h (not the run's time)" in format_report(s)


def test_a_preemption_then_resume_splits_the_restart_into_its_phases():
    s = report("preempted")
    first, second = s["attempts"]
    assert (first["end_reason"], first["signal"], second["end_reason"]) == ("preempted", "SIGTERM", "finished")
    (r,) = s["restarts"]
    # Signal at 1052.0 (the first rank's), last attempt_end 1056, last record 1056, next process start 1080,
    # load 3 s, first step at 1100.
    assert phases(r) == (4.0, 0.0, 24.0, None, 3.0, 17.0)
    assert r["restart_s"] == 48.0 == sum(p for p in phases(r) if p is not None)
    # The preemption checkpoint held step 33, where the attempt stopped: nothing recomputed, not a failure.
    assert (r["cause"], r["resumed_step"], r["lost_steps"], r["failure"]) == ("preempted", 33, 0, False)
    # Wall: 56 + 41 s of attempts + the 24 s gap before the restart.
    assert s["totals"]["wall_s"] == 121.0
    # Attempt 0 trained steps 31..33 after its last progress line (step 30): 3 steps at its own 24 s / 30 steps.
    assert (first["estimated_steps"], first["estimated_productive_s"]) == (3, pytest.approx(2.4))
    assert first["productive_s"] == pytest.approx(26.4)
    assert s["ettr"] == pytest.approx((39 + 2.4) / 121)
    assert s["checkpoint_interval"]["mtbf_source"] == "assumed"
    text = format_report(s)
    assert "ended: preempted (SIGTERM)" in text
    assert (
        "restart before attempt 1 (after: preempted): 48.0s = detection 4.0s, exit 0.0s, relaunch 24.0s, load 3.0s,"
        " first step 17.0s; resumed at step 33, recomputed 0 steps" in text
    )


def test_a_hang_then_resume_counts_the_idle_time_as_detection_and_is_a_failure():
    s = report("hung")
    assert [a["end_reason"] for a in s["attempts"]] == ["hung", "finished"]
    (r,) = s["restarts"]
    # The watchdog fired at 1110 after 60 s idle: the fault is at 1050; attempt_end at 1112; restart at 1130.
    assert phases(r) == (62.0, 0.0, 18.0, 12.0, 2.5, 5.5)  # start-up from the resumed event
    assert r["restart_s"] == 100.0
    # Attempt 0 reached step 27 (its hang event), attempt 1 resumed at 20: 7 steps again.
    assert (r["lost_steps"], r["failure"]) == (7, True)
    ci = s["checkpoint_interval"]
    assert (ci["failures"], ci["mtbf_source"], ci["mtbf_s"]) == (1, "observed", 161.0)
    assert ci["interval_s"] == pytest.approx(math.sqrt(2 * 0.5 * 161.0))


def test_a_killed_attempt_is_inferred_and_its_restart_runs_from_the_last_progress():
    s = report("killed")
    assert [a["end_reason"] for a in s["attempts"]] == ["killed", "finished"]
    (r,) = s["restarts"]
    # Nothing recorded the stop: detection runs from the last progress (1050) to the next process start (1075).
    assert phases(r) == (25.0, None, None, None, 2.0, 18.0)
    assert r["restart_s"] == 45.0
    # Steps 21..30 again; the progress interval (20, 30] took 8 s.
    assert (r["lost_steps"], r["lost_s"], r["failure"]) == (10, 8.0, True)
    assert s["ettr"] == pytest.approx((40 - 8) / (50 + 41 + 25))
    assert "detection, exit and relaunch 25.0s, load 2.0s, first step 18.0s" in format_report(s)


def test_one_rank_killed_while_the_others_record_the_teardown_signal_is_a_kill():
    # Rank 1 vanishes without a record; torchrun then stops rank 0 with SIGTERM, which rank 0 records.
    recorded = history("preempted")
    events = [e for e in recorded if not (e["rank"] == 1 and e["attempt"] == 0 and e["event"] != "attempt_start")]
    s = summarize(events)
    first = s["attempts"][0]
    assert (first["end_reason"], first["killed_ranks"]) == ("killed", [1])
    assert s["restarts"][0]["failure"] is True
    # Rank 0 recorded its end: the text says who recorded nothing and what the others wrote, not "no end recorded".
    text = format_report(s)
    assert "ended: killed: rank 1 recorded no end; the others recorded preempted (SIGTERM)" in text
    assert "restart before attempt 1 (after: killed: rank 1 recorded no end)" in text
    assert "no end recorded" not in text


def test_each_incident_counts_once_however_many_ranks_recorded_it():
    # Both ranks of attempt 0 recorded the one preemption; both recorded the hang of an added attempt.
    events = history("preempted")
    s = summarize(events)
    (preempted,) = [i for i in s["incidents"] if i["event"] == "preempted"]
    assert (preempted["ranks_recorded"], preempted["time"]) == ([0, 1], 1053.0)
    hang = {"run_id": "pre", "attempt": 1, "event": "hang", "step": 40, "idle_s": 60.0, "ranks": [1]}
    events += [hang | {"time": 1110.0, "rank": 0}, hang | {"time": 1111.0, "rank": 1}]
    assert "incidents: 1 hang, 1 preempted" in format_report(summarize(events))


def test_an_attempt_that_crashed_while_loading_trained_no_step():
    # Attempt 1 resumed at step 33 and crashed before its first step; its records say step 0 (not yet restored).
    events = [
        e | ({"reason": "crashed", "step": 0} if (e["event"], e["attempt"]) == ("attempt_end", 1) else {})
        for e in history("preempted")
        if not (e["attempt"] == 1 and e["event"] in ("first_step", "progress", "checkpoint_committed"))
    ]
    s = summarize(events)
    second = s["attempts"][1]
    assert (second["end_reason"], second["start_step"], second["last_step"]) == ("crashed", 33, None)
    text = format_report(s)
    assert "no step trained (resumed at step 33)" in text and "33..0" not in text


def test_a_crashed_last_attempt_is_reported_and_counted_as_a_failure():
    s = report("crashed")
    (attempt,) = s["attempts"]
    assert attempt["end_reason"] == "crashed"
    assert s["restarts"] == []
    ci = s["checkpoint_interval"]
    assert (ci["failures"], ci["mtbf_s"]) == (1, 45.5)
    assert "ended: crashed" in format_report(s)


def test_restarts_at_other_world_sizes_weigh_device_time_by_each_attempt():
    s = report("world_sizes")
    assert [(a["world_size"], a["end_reason"]) for a in s["attempts"]] == [
        (4, "crashed"),
        (2, "preempted"),
        (4, "finished"),
    ]
    crash, preempt = s["restarts"]
    # Rank 2 crashed first (1052); the others' watchdogs then found them hung, at 1060: the crash is the cause.
    assert phases(crash) == (8.0, 0.0, 20.0, None, 3.0, 17.0)
    # Steps 21..32 again: 8 s measured over (20, 30], and steps 31, 32 after the last progress line at 0.8 s each.
    assert (crash["cause"], crash["lost_steps"], crash["failure"]) == ("crashed", 12, True)
    assert crash["lost_s"] == pytest.approx(9.6)
    assert phases(preempt) == (4.0, 0.0, 22.0, None, 4.0, 16.0)
    assert (preempt["lost_steps"], preempt["failure"]) == (0, False)
    t = s["totals"]
    # Wall: 60 + 48 + 41 s of attempts + 20 + 22 s of gaps before restarts.
    assert t["wall_s"] == 191.0
    # Held: 4 x 60 + 2 x 48 + 4 x 41, and each gap at the world size being relaunched: 2 x 20 + 4 x 22.
    assert t["device_s_held"] == 628.0
    # Productive: 24 + 2 x 0.8 (steps 31, 32 estimated), 16 + 4 x 0.8 (41..44), 12.8 s.
    assert [a["productive_s"] for a in s["attempts"]] == pytest.approx([25.6, 19.2, 12.8])
    # Useful: 4 x (25.6 - 9.6) + 2 x 19.2 + 4 x 12.8 device-s.
    assert s["device_utilisation"] == pytest.approx(153.6 / 628)
    assert s["ettr"] == pytest.approx((57.6 - 9.6) / 191)
    assert s["checkpoint_interval"]["mtbf_s"] == 191.0
    assert "world size 4 -> 2" in format_report(s)


def test_a_given_mtbf_replaces_the_observed_one_in_the_suggestion():
    ci = report("hung", mtbf_hours=2.0)["checkpoint_interval"]
    assert (ci["mtbf_source"], ci["mtbf_s"], ci["observed_mtbf_s"]) == ("given", 7200.0, 161.0)
    assert ci["interval_s"] == pytest.approx(math.sqrt(2 * 0.5 * 7200))
    with pytest.raises(ValueError, match="mtbf_hours=0"):
        summarize([], mtbf_hours=0)


def test_a_log_without_attempt_end_falls_back_on_its_preempted_events():
    # lightning-ft 0.1.0 wrote no attempt_end: the preemption is still named; the last attempt's end is unknown.
    events = [e for e in history("preempted") if e["event"] != "attempt_end"]
    s = summarize(events)
    assert [a["end_reason"] for a in s["attempts"]] == ["preempted", "unknown"]
    assert s["restarts"][0]["cause"] == "preempted"
    assert "no end recorded (still running, or killed)" in format_report(s)


def test_a_restart_without_a_resumed_event_loses_every_step_of_the_stopped_attempt():
    events = [e for e in history("killed") if e["event"] != "resumed"]
    (restart,) = summarize(events)["restarts"]
    assert (restart["resumed_step"], restart["lost_steps"], restart["lost_s"]) == (0, 30, 24.0)


def test_only_the_latest_run_in_a_shared_log_is_summarized():
    other = [dict(e, run_id="old", time=e["time"] - 5000) for e in history("hung")]
    s = summarize(other + history("finished"))
    assert s["run_id"] == "fin"
    assert s["totals"]["attempts"] == 1


def test_the_highest_step_an_earlier_attempt_recorded():
    events = history("world_sizes")
    assert highest_step(events, "ws", before_attempt=1) == 32
    assert highest_step(events, "ws", before_attempt=2) == 44
    assert highest_step(events, "ws", before_attempt=0) == -1


def test_an_empty_log_gives_an_empty_summary():
    s = summarize([])
    assert s["ettr"] is None
    assert s["totals"]["attempts"] == 0
    assert "0 attempt(s)" in format_report(s)


@pytest.mark.parametrize("name", ["world_sizes", "tiers"])
def test_the_timeline_is_written_as_a_png(tmp_path, name):
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    plot_timeline(history(name), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _legend(axes) -> list[str]:
    return axes.get_legend_handles_labels()[1]


def test_the_timeline_marks_every_end_shades_start_up_apart_from_recovery_and_names_the_checkpoints():
    plt = pytest.importorskip("matplotlib.pyplot")
    # killed: attempt 0 of "killed" (SIGKILL, no record); then a crash, a preemption, a hang and a finish elsewhere.
    for name, ends in [
        ("killed", ["killed (no end recorded)", "finished"]),
        ("world_sizes", ["crashed", "preempted", "finished"]),
        ("hung", ["hung", "finished"]),
    ]:
        fig = timeline_figure(history(name))
        try:
            steps, bars = fig.axes
            labels = _legend(steps)
            assert [label for label in labels if label.startswith("ended: ")] == [f"ended: {e}" for e in ends]
            assert "checkpoint committed" in labels
            # The first attempt's start-up is start-up, a restarted attempt's is recovery.
            assert [label for label in _legend(bars) if label in ("start-up", "recovery")] == ["start-up", "recovery"]
            start_up = next(c for c in bars.collections if c.get_label() == "start-up")
            assert start_up.get_paths()[0].vertices[:, 0].min() == 0.0  # from the first process start
        finally:
            plt.close(fig)


def test_an_evicted_node_and_its_refused_join_are_listed_once_per_node():
    # histories/tiers: rank 0 records node-c's eviction at 1202; node-c's ranks 2 and 3 each record their refusal.
    s = summarize(history("tiers"))
    (evicted,) = [i for i in s["incidents"] if i["event"] == "node_evicted"]
    assert {k: evicted[k] for k in ("time", "attempt", "host", "ranks", "source", "reason", "cooldown_s")} == {
        "time": 1202.0,
        "attempt": 2,
        "host": "node-c",
        "ranks": [2, 3],
        "source": "straggler",
        "reason": "rank 2 1.30x the median for 50 steps",
        "cooldown_s": 600.0,
    }
    (refused,) = [i for i in s["incidents"] if i["event"] == "join_refused"]
    assert (refused["time"], refused["host"], refused["ranks"], refused["until"], refused["exit_code"]) == (
        1225.0,
        "node-c",
        [2, 3],
        1802.0,
        75,
    )
    text = format_report(s)
    assert "incidents: 1 checkpoint_failed, 2 checkpoint_rejected, 1 join_refused, 1 node_evicted" in text
    # Times from the run's first process start (1000).
    assert (
        "    node evicted: host node-c (ranks 2, 3), attempt 2, 202.0s into the run, source straggler: rank 2 1.30x"
        " the median for 50 steps; cooldown 600.0s" in text
    )
    assert (
        "    join refused: host node-c (ranks 2, 3), attempt 3, 225.0s into the run: evicted at 1202 (straggler);"
        " cooldown until 1802; refused until 577.0s later (exit code 75)" in text
    )


def test_an_eviction_every_rank_recorded_counts_once_and_a_refusal_makes_no_attempt():
    events = history("tiers")
    (evicted,) = [e for e in events if e["event"] == "node_evicted"]
    events.append(evicted | {"rank": 1, "time": 1202.5})
    # The refusing processes counted one attempt more than the run has: still no attempt of their own.
    events = [e | {"attempt": 4} if e["event"] == "join_refused" else e for e in events]
    s = summarize(events)
    assert s["totals"]["attempts"] == 4
    assert [a["world_size"] for a in s["attempts"]] == [4, 4, 4, 2]
    counts = {name: sum(1 for i in s["incidents"] if i["event"] == name) for name in ("node_evicted", "join_refused")}
    assert counts == {"node_evicted": 1, "join_refused": 1}
    (first,) = [i for i in s["incidents"] if i["event"] == "node_evicted"]
    assert first["ranks_recorded"] == [0, 1]
    # Two nodes evicted at once are two incidents.
    events.append(evicted | {"host": "node-d", "ranks": [4, 5]})
    assert sum(1 for i in summarize(events)["incidents"] if i["event"] == "node_evicted") == 2


def test_a_refusal_of_another_run_is_not_this_run_s():
    events = [e | {"run_id": "other"} if e["event"] == "join_refused" else e for e in history("tiers")]
    assert [i for i in summarize(events)["incidents"] if i["event"] == "join_refused"] == []


def _line(time, attempt, event, step=None, rank=0, **fields):
    return {"time": time, "run_id": "r", "attempt": attempt, "rank": rank, "event": event, "step": step, **fields}


def test_an_attempt_killed_before_its_first_progress_line_counts_its_steps_at_the_run_s_step_time():
    # The issue's case: log_every_n_steps=50, killed after step 40's checkpoint, before any progress line.
    events = [
        _line(1005.0, 0, "attempt_start", world_size=1, process_start_time=1000.0),
        _line(1020.0, 0, "first_step", 1),
        _line(1060.0, 0, "checkpoint_committed", 40, path="ckpt/step=40", stall_s=0.1, total_s=0.5),
        _line(1085.0, 1, "attempt_start", world_size=1, process_start_time=1080.0),
        _line(1090.0, 1, "resumed", 40, path="ckpt/step=40", load_s=1.0),
        _line(1095.0, 1, "first_step", 41),
        _line(1105.0, 1, "progress", 50, productive_s=9.0, data_wait_s=0.5),
        _line(1115.0, 1, "progress", 60, productive_s=9.0, data_wait_s=0.5),
        _line(1116.0, 1, "attempt_end", 60, reason="finished"),
    ]
    s = summarize(events)
    killed, finished = s["attempts"]
    assert (killed["end_reason"], killed["last_step"]) == ("killed", 40)
    # 40 steps at the next attempt's 18 s / 20 steps, not "productive 0.0s".
    assert (killed["estimated_steps"], killed["productive_s"]) == (40, pytest.approx(36.0))
    assert finished["estimated_steps"] == 0 and finished["productive_s"] == 18.0
    (r,) = s["restarts"]
    # The kill is placed where the attempt was last seen (step 40's checkpoint at 1060), not at its process start.
    assert (r["fault_time"], r["detection_s"], r["restart_s"]) == (1060.0, 20.0, 35.0)
    assert s["ettr"] == pytest.approx((36.0 + 18.0) / (60.0 + 36.0 + 20.0))
    assert "productive 36.0s (36.0s of it estimated: 40 step(s) after its last progress line)" in format_report(s)


def test_without_any_progress_line_the_step_time_comes_from_the_attempt_s_own_records():
    events = [
        _line(1005.0, 0, "attempt_start", world_size=1, process_start_time=1000.0),
        _line(1020.0, 0, "first_step", 1),
        _line(1040.0, 0, "fault_injected", 21, kind="kill_at"),
    ]
    (a,) = summarize(events)["attempts"]
    # Steps 1 -> 21 took 20 s: 1 s a step, for the 21 steps trained.
    assert (a["end_reason"], a["estimated_steps"], a["productive_s"]) == ("unknown", 21, pytest.approx(21.0))


def test_the_report_says_when_start_up_dominates_a_short_run():
    events = [
        _line(1005.0, 0, "attempt_start", world_size=2, process_start_time=1000.0),
        _line(1036.0, 0, "first_step", 1),
        _line(1038.0, 0, "progress", 40, productive_s=1.6, data_wait_s=0.2),
        _line(1040.0, 0, "attempt_end", 40, reason="finished"),
    ]
    s = summarize(events)
    assert s["totals"]["startup_s"] == 36.0 and s["ettr"] == pytest.approx(1.6 / 40)
    assert (
        "start-up dominates: 36.0s of the 40.0s wall (90.0%) ran from process start to the first step (imports,"
        " process group, model set-up, checkpoint load), which a longer run spreads over more steps; after start-up"
        " the ratio is 40.0%" in format_report(s)
    )
    # A run where training is most of the time says nothing of it.
    assert "start-up dominates" not in format_report(report("finished"))
