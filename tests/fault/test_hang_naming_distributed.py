"""Hang naming on 3 real ranks under torchrun (gloo): rank 2 stops for good at step 4, a checkpoint step, in each of
four places, and every rank's ``hang`` event names rank 2. Before each rank said whether it waits in a collective,
the first placement named rank 0 or 1 (all three had passed the same progress points: the tie went by time).

The watchdog fires after ``hang_timeout_s=20``: the heartbeats are published every second and a rank counts as
silent only after 5 s without one, margins that hold on a loaded 2-core machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.fault.internal import HANG_EXIT_CODE
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("hang_script.py")


def run_stuck(root: Path, stuck: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=3"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--root", str(root), "--stuck", stuck, "--rank", "2", "--step", "4"]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stuck", "others_wait_in"),
    [
        ("callback", {"barrier", "broadcast", "broadcast_object_list", "all_gather_object", "all_gather"}),
        ("data", {"ddp_backward"}),
        ("compute", {"ddp_backward"}),
        ("collective", {"ddp_backward"}),
    ],
)
def test_every_rank_names_the_stuck_rank_wherever_it_stopped(tmp_path, stuck, others_wait_in):
    proc = run_stuck(tmp_path, stuck)
    assert proc.returncode != 0, proc.stdout[-3000:]
    hangs = [e for e in read_events(tmp_path) if e["event"] == "hang"]
    assert hangs, f"no hang event\n{proc.stderr[-5000:]}"
    for hang in hangs:
        assert hang["first_rank"] == 2 and hang["ranks"] == [2], hang
        beats = hang["heartbeats"]
        for rank in ("0", "1"):
            assert beats[rank]["collective"] in others_wait_in, beats
        assert beats["2"]["collective"] == ("all_reduce" if stuck == "collective" else None), beats
        if stuck == "collective":
            # Every rank waits; rank 2 is behind (ranks 0 and 1 entered step 4's backward before rank 2 reached its
            # all_reduce in the forward, so the earliest collective alone would not name it).
            assert beats["2"]["points"] < min(beats[r]["points"] for r in ("0", "1"))
            assert hang["waiting"] == [0, 1, 2]
    ends = [e for e in read_events(tmp_path) if e["event"] == "attempt_end" and e["reason"] == "hung"]
    assert any(e["exit_code"] == HANG_EXIT_CODE for e in ends)
