"""A replacement replica group that heals from a live group is a heal, not a restart that lost work, in its own
report and in the job's; the job's ETTR is never negative.

``histories/replica_replaced`` is recorded from tests/replica/test_replica_defaults_e2e.py (every default, three
one-process groups under torchrun): group 0, the checkpoint writer, healed at step 16, is SIGKILLed in a checkpoint
write after step 30 (groups 1 and 2 stall 1.26 s, one discarded step); its replacement, launched with group 0's id
and folder (attempt 1 of group 0's run), heals from group 1 at step 283; all finish at step 301. Before lightning-ft
counted a heal, group 0's report said ``resumed at step 0, recomputed 30 steps``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.goodput_text import format_report
from lightning_ft.monitors.replica_job import find_group_runs, format_job_report, summarize_job

REPLACED = Path(__file__).parent / "histories" / "replica_replaced"


def test_the_replacement_s_heal_starts_its_attempt_at_the_live_step_and_recomputes_nothing():
    report = summarize(read_events(REPLACED / "g0"))
    first, second = report["attempts"]
    assert (first["start_step"], first["last_step"], first["end_reason"]) == (16, 30, "killed")
    assert (second["healed_step"], second["start_step"], second["last_step"]) == (283, 283, 301)
    (restart,) = report["restarts"]
    assert restart["healed"] and restart["resumed_step"] == 283
    assert (restart["lost_steps"], restart["lost_s"]) == (0, 0.0)
    assert report["totals"]["lost_steps"] == 0
    assert 0 < report["ettr"] < 1
    text = format_report(report)
    assert "attempt 1: world size 1, wall 20.1s, steps 283..301" in text
    assert "healed at step 283 from a live replica group, recomputed 0 steps (0.0s)" in text
    assert "recomputed 30" not in text


def test_a_survivor_s_report_counts_the_discarded_step_not_the_wait_for_the_quorum():
    report = summarize(read_events(REPLACED / "g1"))
    t = report["totals"]
    assert (t["replicas_lost"], t["discarded_steps"]) == (1, 1)
    assert t["replica_stall_s"] == pytest.approx(1.261, abs=1e-3)
    (attempt,) = report["attempts"]
    steps = attempt["last_step"] - attempt["start_step"]
    # One discarded step of the attempt's steps, at the attempt's own time per step: not the 1.26 s stall.
    assert t["lost_s"] == t["replica_discarded_s"] == pytest.approx(attempt["productive_s"] / (steps + 1))
    assert report["ettr"] == pytest.approx((t["productive_s"] - t["lost_s"]) / t["wall_s"])


def test_the_job_counts_the_heal_once_and_its_ettr_is_the_steps_time_over_the_wall():
    job = summarize_job(find_group_runs(REPLACED))
    (failure,) = job["failures"]
    assert (failure["replica_id"], failure["step"], failure["how"], failure["discarded_steps"]) == ("0", 30, "lost", 1)
    assert job["committed_steps"] == 301
    assert job["discarded_s"] == pytest.approx(job["step_s"] / 301)
    assert job["ettr"] == pytest.approx((job["step_s"] - job["discarded_s"]) / job["wall_s"])
    assert [(h["replica_id"], h["step"]) for h in job["heals"]] == [("1", 7), ("0", 16), ("0", 283)]
    assert "less 0.11 s of discarded steps" in format_job_report(job)


def test_a_lighthouse_outage_s_long_stall_never_makes_the_job_s_ettr_negative(tmp_path):
    # The recorded job, with the stall a lighthouse that stays down leaves: every survivor waits 120 s for a quorum
    # (longer than all the steps the job trained). The stall is wall time in which no step trained; subtracting it
    # from the steps' time as well made the report say a negative ETTR.
    shutil.copytree(REPLACED, tmp_path / "job")
    for group in ("g1", "g2"):
        log = tmp_path / "job" / group / "lightning-ft" / "events" / "rank0.jsonl"
        events = [json.loads(line) for line in log.read_text().splitlines()]
        lost = next(e for e in events if e["event"] == "replica_lost")
        events.append({**lost, "time": lost["time"] + 121, "step": 31, "replica_id": "0", "stall_s": 120.0})
        log.write_text("".join(json.dumps(e) + "\n" for e in events))
    job = summarize_job(find_group_runs(tmp_path / "job"))
    assert job["stall_s"] == pytest.approx(121.26, abs=0.01) and job["stall_s"] > job["step_s"]
    assert job["ettr"] is not None and job["ettr"] > 0
    for group in ("g1", "g2"):
        assert summarize(read_events(tmp_path / "job" / group))["ettr"] >= 0
