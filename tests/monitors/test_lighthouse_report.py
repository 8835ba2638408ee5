"""Lighthouse outages in the reports (``lightning-ft report``, one group's run and ``--job``): each outage listed with
how long the lighthouse did not answer and what it cost, each loss past ``lighthouse_wait`` with the checkpoint
committed; the ETTR holds an outage in the wall time only, and the job's is never negative. Events written by hand,
fields as docs/replica-groups-reference.md lists them."""

from __future__ import annotations

import pytest

from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.goodput_text import format_report
from lightning_ft.monitors.replica_job import format_job_report, summarize_job
from tests.monitors.test_replica_job import _event, _group


def _with_outage(replica_id: str, *, down_since: float, down_s: float, stall_s: float, end: float = 100.0) -> dict:
    """A group that trains steps 1..100 (50 s of steps) and lives through one outage at step 40, its quorum
    answered at ``down_since + stall_s``; the quorum's wait is in the progress record's data wait."""
    run = f"r{replica_id}"
    answered = down_since + stall_s
    events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
    events.append(_event("first_step", 1.0, run, step=1))
    events.append(_event("progress", down_since, run, step=40, productive_s=20.0, data_wait_s=1.0))
    events.append(
        _event(
            "lighthouse_outage",
            answered,
            run,
            step=40,
            lighthouse="http://lh:1",
            down_s=down_s,
            stall_s=stall_s,
            down_since=down_since,
        )
    )
    events.append(_event("progress", end, run, step=100, productive_s=30.0, data_wait_s=stall_s + 1.0))
    events.append(_event("attempt_end", end, run, step=100, exit_code=0, reason="finished"))
    return _group(replica_id, run, events)


def test_one_groups_report_lists_the_outage_and_its_ettr_holds_it_in_the_wall_time_only():
    run = _with_outage("0", down_since=40.0, down_s=12.0, stall_s=13.0)
    summary = summarize(run["events"])
    assert summary["totals"]["lighthouse_outages"] == 1
    assert summary["totals"]["lighthouse_stall_s"] == 13.0
    assert summary["ettr"] == pytest.approx(50.0 / 100.0)  # 50 s of steps over 100 s: nothing subtracted twice
    [outage] = summary["replicas"]["lighthouse_outages"]
    assert (outage["step"], outage["down_s"], outage["stall_s"]) == (40, 12.0, 13.0)
    [incident] = [i for i in summary["incidents"] if i["event"] == "lighthouse_outage"]
    assert incident["down_s"] == 12.0
    text = format_report(summary)
    assert "lighthouse: 1 outage(s) lived through (down 12.0s, the quorums waited 13.0s" in text
    assert "step 40: lighthouse down 12.0s, the quorum waited 13.0s" in text


def test_the_job_report_lists_an_outage_once_with_the_longest_wait_of_its_groups():
    runs = [
        _with_outage("0", down_since=40.0, down_s=12.0, stall_s=13.0),
        _with_outage("1", down_since=40.3, down_s=11.8, stall_s=12.9),
        _with_outage("2", down_since=39.8, down_s=12.1, stall_s=13.4),
    ]
    job = summarize_job(runs)
    [outage] = job["lighthouse"]["outages"]
    assert outage["step"] == 40 and outage["t"] == pytest.approx(39.8)
    assert (outage["down_s"], outage["stall_s"]) == (12.1, 13.4)
    assert outage["stall_by_group"] == {"0": 13.0, "1": 12.9, "2": 13.4}
    assert job["ettr"] == pytest.approx(50.0 / 100.0)
    text = format_job_report(job)
    assert "lighthouse: 1 outage(s) lived through (down 12.10 s, quorums waited 13.40 s" in text
    assert "t=39.80 s step 40: down 12.10 s; stall 13.40 s (group 0 13.00 s, group 1 12.90 s, group 2 13.40 s)" in text


def test_two_outages_apart_in_time_are_two():
    runs = [_with_outage("0", down_since=20.0, down_s=2.0, stall_s=3.0)]
    runs[0]["events"].insert(
        -2,
        _event(
            "lighthouse_outage", 63.0, "r0", step=70, lighthouse="http://lh:1", down_s=1.0, stall_s=2.0, down_since=61.0
        ),
    )
    assert [o["step"] for o in summarize_job(runs)["lighthouse"]["outages"]] == [40, 70]


def test_a_lighthouse_gone_past_lighthouse_wait_names_the_groups_that_stopped_and_the_checkpoint():
    runs = []
    for replica_id, path in (("0", "/ckpt/preempt-step=40"), ("1", None)):
        run = f"r{replica_id}"
        events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
        events.append(_event("first_step", 1.0, run, step=1))
        events.append(_event("progress", 30.0, run, step=40, productive_s=20.0))
        events.append(
            _event("lighthouse_lost", 45.0, run, step=40, lighthouse="http://lh:1", waited_s=10.2, checkpoint_path=path)
        )
        events.append(_event("attempt_end", 45.5, run, step=40, reason="stopped", exit_code=75))
        runs.append(_group(replica_id, run, events))
    job = summarize_job(runs)
    [gone] = job["lighthouse"]["lost"]
    assert gone["groups"] == ["0", "1"] and gone["checkpoint_path"] == "/ckpt/preempt-step=40"
    assert gone["waited_s"] == 10.2
    text = format_job_report(job)
    assert "step 40: did not answer for 10.20 s; groups 0, 1 stopped, /ckpt/preempt-step=40 committed" in text
    assert "stopped: the lighthouse did not answer for 10.20 s" in text  # how each group's attempt ended
    one = format_report(summarize(runs[0]["events"]))
    assert "step 40: lighthouse did not answer for 10.2s: stopped, committed /ckpt/preempt-step=40" in one


def test_the_job_ettr_is_never_negative():
    """Lost groups that cost more discarded steps than the job committed (a job whose groups all failed and stopped):
    0, not below. The survivors' wait for the next quorum is wall time, never subtracted again."""
    run = "r0"
    events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
    events.append(_event("first_step", 1.0, run, step=1))
    events.append(_event("replica_lost", 5.0, run, replica_id="1", step=3, stall_s=30.0, discarded_steps=10))
    events.append(_event("progress", 40.0, run, step=4, productive_s=2.0))
    job = summarize_job([_group("0", run, events)])
    assert job["discarded_s"] > job["step_s"] and job["ettr"] == 0.0
