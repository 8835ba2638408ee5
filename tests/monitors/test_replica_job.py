"""One report of a job of replica groups (``lightning-ft report FOLDER``), from every group's event log.

``histories/replica_job`` is recorded from a real run (tests/replica/test_replica_health_eviction_e2e.py, the
``thermal`` case; paths shortened to /tmp/run): three one-process groups under torchrun, group 2 joins first and
heals from group 1, group 0 joins at step 1 and heals from group 1; group 2's device reads a thermal slowdown twice
and ``ThermalMonitor(action="evict")`` evicts it after step 16; groups 0 and 1 record its loss (stalls 0.594 s and
0.595 s) and finish at step 160; group 2's relaunch is refused (its node's cooldown). ``histories/replica_job_killed``
is recorded from tests/replica/test_replica_groups_e2e.py's ``sigkill`` case: group 2 is SIGKILLed mid-step after step
9 (stalls 0.864 s and 0.853 s, one discarded step), its replacement (folder ``g2b``, the same replica id) heals from
group 0 at step 66; all finish at step 600. The other cases are written by hand, fields as docs/replica-groups-reference.md
lists them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.cli import main
from lightning_ft.monitors.replica_job import find_group_runs, format_job_report, summarize_job

JOB = Path(__file__).parent / "histories" / "replica_job"
KILLED = Path(__file__).parent / "histories" / "replica_job_killed"


def test_a_recorded_job_is_one_report_with_the_eviction_once_and_every_step_once():
    runs = find_group_runs(JOB)
    assert [(r["replica_id"], Path(r["folder"]).name) for r in runs] == [("0", "g0"), ("1", "g1"), ("2", "g2")]
    assert {r["job"] for r in runs} == {"http://127.0.0.1:39991"}
    job = summarize_job(runs)
    (failure,) = job["failures"]  # two survivors recorded it: one failure
    assert (failure["replica_id"], failure["step"], failure["how"]) == ("2", 16, "evicted")
    assert failure["detail"].startswith("thermal: rank(s) [0]: GPU held down"), failure
    assert failure["stall_by_group"] == {"0": pytest.approx(0.5936, abs=1e-4), "1": pytest.approx(0.5949, abs=1e-4)}
    assert failure["stall_s"] == failure["stall_by_group"]["1"] == job["stall_s"]
    assert failure["discarded_steps"] == job["discarded_steps"] == 0
    assert [(c["step"], c["live_groups"]) for c in job["live_groups"]] == [(0, 2), (1, 3), (16, 2)]
    assert [(h["replica_id"], h["source"], h["bytes"]) for h in job["heals"]] == [("2", "1", 20249), ("0", "1", 28528)]
    # Steps 1..160, each once, though two or three groups trained most of them side by side.
    assert job["committed_steps"] == 160
    groups = {g["replica_id"]: g for g in job["groups"]}
    assert [a["ended"] for a in groups["2"]["attempts"]] == [
        "evicted (thermal)",
        "refused to join (its node's cooldown)",
    ]
    assert [(a["first_step"], a["last_step"]) for a in groups["2"]["attempts"]] == [(1, 16), (None, 0)]
    assert [a["ended"] for a in groups["0"]["attempts"]] == ["finished"]
    # The wall: from the first process start to the last attempt that trained (the refused relaunch came after).
    starts = [json.loads(line) for g in ("g0", "g1", "g2") for line in _lines(g) if '"attempt_start"' in line]
    first_start = min(e["process_start_time"] for e in starts)
    last_end = max(json.loads(line)["time"] for g in ("g0", "g1") for line in _lines(g))
    assert job["wall_s"] == pytest.approx(last_end - first_start)
    # No step discarded: the stall (the wait for the next quorum) is wall time in which no step was trained, counted
    # once that way (subtracting it from the steps' time too made a long outage read as a negative ETTR).
    assert job["discarded_s"] == 0 and job["ettr"] == pytest.approx(job["step_s"] / job["wall_s"])
    assert 0 < job["ettr"] < 1


def test_a_recorded_kill_and_replacement_is_a_lost_group_its_stall_and_the_replacement_s_heal():
    job = summarize_job(find_group_runs(KILLED))
    (failure,) = job["failures"]
    assert (failure["replica_id"], failure["step"], failure["how"], failure["discarded_steps"]) == ("2", 9, "lost", 1)
    assert failure["detail"] == "its log ends without a record (killed, or its node went away)"
    assert failure["stall_s"] == pytest.approx(0.8636, abs=1e-4)
    assert [(h["replica_id"], h["source"], h["step"]) for h in job["heals"]] == [
        ("2", "0", 3),
        ("1", "0", 4),
        ("2", "0", 66),
    ]
    # The killed run and its replacement: one group, two runs, each with its own attempts.
    runs = [(g["replica_id"], Path(g["folder"]).name, [a["ended"] for a in g["attempts"]]) for g in job["groups"]]
    assert runs == [
        ("0", "g0", ["finished"]),
        ("1", "g1", ["finished"]),
        ("2", "g2", ["its log ends without a record (killed, or its node went away)"]),
        ("2", "g2b", ["finished"]),
    ]
    assert [c["live_groups"] for c in job["live_groups"]] == [1, 2, 3, 2, 3]
    assert job["committed_steps"] == 600 and job["discarded_steps"] == 1


def _lines(group: str) -> list[str]:
    return (JOB / group / "lightning-ft" / "events" / "rank0.jsonl").read_text().splitlines()


def test_the_text_names_each_failure_heal_and_group(capsys):
    assert main(["report", str(JOB)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replica job (lighthouse http://127.0.0.1:39991): 3 group run(s), wall ")
    assert "  live groups: 2 from t=" in out and "(step 16)" in out
    assert "step 16: group 2 evicted (thermal: rank(s) [0]" in out
    assert "stall 0.59 s (group 0 0.59 s, group 1 0.59 s), 0 discarded step(s)" in out
    assert "step 0: group 2 from group 1, 20.2 KB in 0.04 s" in out
    assert "attempt 1: " in out and "no step trained, refused to join (its node's cooldown)" in out


def test_one_group_s_folder_still_gets_the_single_run_report(capsys):
    assert main(["report", str(JOB / "g0")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run 68c8c6164487: 1 attempt(s)") and "replica job" not in out


def test_groups_sharing_one_root_are_a_job_with_job(tmp_path, capsys):
    """Groups that share a ``default_root_dir``: the first owns its event log, the others are its other runs
    (``lightning-ft/runs/<run_id>``); the folder's report stays the owner's, ``--job`` reports the job."""
    root = tmp_path / "shared"
    shutil.copytree(JOB / "g0" / "lightning-ft", root / "lightning-ft")
    for group, run_id in (("g1", "b4bf64f43b14"), ("g2", "54f07adbc3a3")):
        shutil.copytree(JOB / group / "lightning-ft" / "events", root / "lightning-ft" / "runs" / run_id / "events")
    assert main(["report", str(root)]) == 0
    assert capsys.readouterr().out.startswith("run 68c8c6164487")
    assert main(["report", str(root), "--job", "--json"]) == 0
    job = json.loads(capsys.readouterr().out)
    assert [g["replica_id"] for g in job["groups"]] == ["0", "1", "2"]
    assert [g["folder"] for g in job["groups"]] == [
        str(root),
        str(root / "lightning-ft" / "runs" / "b4bf64f43b14"),
        str(root / "lightning-ft" / "runs" / "54f07adbc3a3"),
    ]
    assert [f["how"] for f in job["failures"]] == ["evicted"]


def test_job_without_groups_and_one_run_options_on_a_job_are_usage_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--job"]) == 2
    assert "--job: no replica group's event log under" in capsys.readouterr().err
    assert main(["report", str(JOB), "--project"]) == 2
    err = capsys.readouterr().err
    assert "--project: for one run, not a job of replica groups" in err and str(JOB / "g0") in err


def _event(event: str, t: float, run_id: str, attempt: int = 0, **fields) -> dict:
    return {"time": t, "run_id": run_id, "attempt": attempt, "rank": 0, "event": event, **fields}


def _group(replica_id: str, run_id: str, events: list[dict], *, job: str = "http://lh:1") -> dict:
    head = _event("replica_group", events[0]["time"], run_id, replica_id=replica_id, lighthouse=job, step=0)
    return {
        "folder": f"/x/{replica_id}",
        "run_id": run_id,
        "replica_id": replica_id,
        "job": job,
        "group_size": 1,
        "events": [head, *events],
    }


def _survivor(replica_id: str, lost: list[tuple[str, int, float, int]], *, end: float = 100.0) -> dict:
    run = f"r{replica_id}"
    events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
    events.append(_event("first_step", 1.0, run, step=1))
    events += [
        _event("replica_lost", 10.0 + i, run, replica_id=g, step=s, stall_s=stall, discarded_steps=d)
        for i, (g, s, stall, d) in enumerate(lost)
    ]
    events.append(_event("progress", end, run, step=100, productive_s=50.0))
    events.append(_event("attempt_end", end, run, step=100, exit_code=0))
    return _group(replica_id, run, events)


def _gone(replica_id: str, last: list[dict], *, end: float = 9.0) -> dict:
    run = f"r{replica_id}"
    events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
    events.append(_event("first_step", 1.0, run, step=1))
    events += last
    events.append(_event("progress", end, run, step=20, productive_s=8.0))
    return _group(replica_id, run, events)


def test_how_each_group_left_comes_from_its_own_log():
    lost = [("2", 20, 1.0, 1), ("3", 21, 2.0, 0), ("4", 22, 0.5, 2), ("5", 23, 0.3, 0)]
    runs = [
        _survivor("0", lost),
        _survivor("1", [(g, s, stall + 0.25, d) for g, s, stall, d in lost]),  # the other survivor waited longer
        _gone("2", [_event("node_evicted", 8.5, "r2", step=20, source="health_check", reason="ECC")]),
        _gone("3", [_event("hang", 8.5, "r3", step=20, idle_s=5.0)]),
        _gone("4", []),  # SIGKILL: the log just ends
        # group 5 has no log under the folder
    ]
    job = summarize_job(runs)
    assert [(f["replica_id"], f["how"]) for f in job["failures"]] == [
        ("2", "evicted"),
        ("3", "hung"),
        ("4", "lost"),
        ("5", "lost"),
    ]
    assert job["failures"][0]["detail"] == "health_check: ECC"
    assert "its log ends without a record" in job["failures"][2]["detail"]
    assert job["failures"][3]["detail"] == "no event log of group 5 under the folder"
    # Each failure once: the longest stall of its survivors, the most steps discarded.
    assert [f["stall_s"] for f in job["failures"]] == [1.25, 2.25, 0.75, 0.55]
    assert job["stall_s"] == pytest.approx(1.25 + 2.25 + 0.75 + 0.55)
    assert job["discarded_steps"] == 3


def test_steps_trained_side_by_side_count_once_and_a_healed_group_counts_from_its_heal():
    """Groups 0 and 1 train steps 1..100 together, at 0.5 and 0.6 s a step by their records (progress every 50
    steps); group 2 heals at step 80 and trains 81..100 at 0.7 s a step: the job trained 100 steps, steps 1..80 at
    the median 0.55 s and 81..100 at the median 0.6 s (a group's first step is the one after its heal)."""
    runs = []
    for replica_id, per_50 in (("0", 25.0), ("1", 30.0)):
        run = f"r{replica_id}"
        events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
        events += [_event("progress", 30.0, run, step=50, productive_s=per_50)]
        events += [_event("progress", 60.0, run, step=100, productive_s=per_50)]
        events += [_event("attempt_end", 60.0, run, step=100, exit_code=0)]
        runs.append(_group(replica_id, run, events))
    late = [_event("attempt_start", 40.0, "r2", world_size=1, process_start_time=40.0)]
    late += [_event("healed", 45.0, "r2", step=80, replica_id="2", source="0", bytes=10, seconds=0.1)]
    late += [_event("progress", 60.0, "r2", step=100, productive_s=14.0)]
    runs.append(_group("2", "r2", late))
    job = summarize_job(runs)
    assert job["committed_steps"] == 100
    assert job["step_s"] == pytest.approx(80 * 0.55 + 20 * 0.6)
    assert job["wall_s"] == 60.0 and job["ettr"] == pytest.approx(56 / 60)


def test_a_membership_seen_by_several_groups_is_one_change():
    runs = []
    for replica_id in ("0", "1"):
        run = f"r{replica_id}"
        events = [_event("attempt_start", 0.0, run, world_size=1, process_start_time=0.0)]
        events += [_event("replica_quorum", 1.0 + int(replica_id) * 0.01, run, step=0, live_groups=2)]
        events += [_event("replica_quorum", 5.0 + int(replica_id) * 0.01, run, step=10, live_groups=1)]
        events += [_event("replica_quorum", 9.0, run, step=20, live_groups=2)]
        runs.append(_group(replica_id, run, events))
    runs[1]["events"] = runs[1]["events"][:-1]  # group 1 was the one that left at step 10 and came back
    job = summarize_job(runs)
    assert [(c["t"], c["step"], c["live_groups"]) for c in job["live_groups"]] == [
        (1.0, 0, 2),
        (5.0, 10, 1),
        (9.0, 20, 2),
    ]
    assert "live groups: 2 from t=1.00 s (step 0), 1 from t=5.00 s (step 10), 2 from t=9.00 s (step 20)" in (
        format_job_report(job)
    )


def test_summarize_job_of_nothing_is_a_value_error():
    with pytest.raises(ValueError, match=r"summarize_job\(runs=\[\]\)"):
        summarize_job([])


def test_the_job_report_imports_neither_lightning_nor_torch():
    from tests.cli.test_report import _REPORT
    from tests.helpers import REPO_ROOT, subprocess_env

    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, str(KILLED)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("replica job (lighthouse http://127.0.0.1:38863): 4 group run(s)")
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_relaunch_that_started_before_the_survivors_recorded_the_loss_is_not_the_attempt_that_left():
    """A group SIGKILLed at step 100 and relaunched into its own run (a shared folder): the relaunch's attempt 1
    starts before the survivors record the loss (a long stall), heals at step 441 and trains to the end. The failure
    is a lost group, not one that "missed a quorum and trained on"; a group that did train on is still ``rejoined``."""
    killed = _gone("2", [], end=12.0)
    killed["events"] += [
        _event("attempt_start", 14.0, "r2", attempt=1, world_size=1, process_start_time=14.0),
        _event("healed", 27.8, "r2", attempt=1, replica_id="2", source="0", step=441, bytes=100, seconds=0.03),
        _event("first_step", 27.9, "r2", attempt=1, step=441),
        _event("progress", 66.0, "r2", attempt=1, step=1500, productive_s=20.0),
        _event("attempt_end", 66.0, "r2", attempt=1, step=1500, exit_code=0),
    ]
    stayed = _gone("3", [], end=12.0)
    stayed["events"] += [_event("progress", 60.0, "r3", step=1500, productive_s=40.0)]
    runs = [_survivor("0", [("2", 101, 5.0, 0), ("3", 101, 1.0, 0)], end=66.0), killed, stayed]
    for run in runs[:1]:
        for e in run["events"]:
            if e["event"] == "replica_lost":
                e["time"] = 17.1
    job = summarize_job(runs)
    assert [(f["replica_id"], f["how"]) for f in job["failures"]] == [("2", "lost"), ("3", "rejoined")]
