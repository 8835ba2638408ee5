"""The README's demo under real torchrun: a rank is SIGKILLed, a rank is preempted, a rank hangs; torchrun restarts
the group after each and training resumes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.monitors.goodput_report import summarize
from tests.e2e._torchrun import torchrun
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow


def test_demo_survives_a_killed_rank_a_preemption_and_a_hang_through_torchrun_restarts(tmp_path):
    root = tmp_path / "demo"
    demo = Path(REPO_ROOT) / "examples" / "demo.py"
    proc = torchrun("--root", str(root), script=demo, max_restarts=3, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "killing myself with SIGKILL" in proc.stdout
    assert "[demo] summary" in proc.stdout

    events = read_events(root)
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert sorted({e["attempt"] for e in starts}) == [0, 1, 2, 3]
    assert {e["torchrun_restart"] for e in starts} == {0, 1, 2, 3}
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 3 and 0 < resumed[0]["step"] < 17
    # Attempt 1: SIGTERM at rank 0; every rank commits preempt-step=<N> and attempt 2 resumes from it.
    preempted = [e for e in events if e["event"] == "preempted"]
    assert sorted(e["rank"] for e in preempted) == [0, 1] and {e["attempt"] for e in preempted} == {1}
    assert resumed[1]["path"] == preempted[0]["checkpoint_path"] and preempted[0]["exit_code"] == 75
    # Attempt 2: rank 1 hangs in a data read; the watchdog names it and torchrun restarts the group.
    hangs = [e for e in events if e["event"] == "hang"]
    assert hangs and all(e["ranks"] == [1] and e["attempt"] == 2 for e in hangs)
    assert 35 <= resumed[2]["step"] <= 42 and resumed[2]["attempt"] == 3
    assert max(e["step"] for e in events if e["event"] == "checkpoint_committed") == 130
    # The injected thermal incident on rank 1 is seen by ThermalMonitor. StragglerMonitor never names another rank;
    # whether it names rank 1 within the demo's last attempt depends on how busy the machine is (its bar rises with
    # the measured noise, by design), so naming is checked where the timings are controlled:
    # tests/monitors/test_straggler_detector.py (recorded busy-host timings) and the extended live run.
    thermal = [e for e in events if e["event"] == "thermal" and e.get("throttled")]
    assert thermal and {e["rank"] for e in thermal} == {1} and "HwThermalSlowdown" in thermal[0]["reasons"]
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert {e["suspect_rank"] for e in stragglers} <= {1}
    # One TensorBoard version folder for both attempts, holding event files.
    versions = list((root / "tb").iterdir())
    assert len(versions) == 1 and list(versions[0].glob("events.out.tfevents.*"))

    report = subprocess.run(
        [sys.executable, "-m", "lightning_ft.cli", "report", str(root)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "restart" in report.stdout and f"straggler detections: {len(stragglers)}" in report.stdout
    # One hang and one preemption, though both ranks recorded each; no attempt's steps run backwards.
    (incidents,) = [line for line in report.stdout.splitlines() if line.strip().startswith("incidents:")]
    assert "1 hang" in incidents and "1 preempted" in incidents, incidents
    steps = [(int(a), int(b)) for a, b in re.findall(r"steps (\d+)\.\.(\d+)", report.stdout)]
    assert steps and all(a <= b for a, b in steps), report.stdout
    # Every attempt's productive time is on record for every step it trained: the killed attempt's surviving rank,
    # the preempted and the hung attempt write the steps since their last progress line before they end (nothing
    # left to estimate), and each attempt that trained has productive time.
    summary = summarize(events)
    for attempt in summary["attempts"]:
        trained = (attempt["last_step"] or 0) - attempt["start_step"]
        assert trained > 0 and attempt["productive_s"] > 0, attempt
        assert attempt["estimated_steps"] == 0, attempt
