"""Preemption under real torchrun with real signals: one torchrun goes through four preemptions in a row, and a
SIGUSR1 sent to torchrun itself (as SLURM's ``--signal=USR1@90`` does) requeues the job through ``scontrol``."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time

import pytest

from lightning_ft.checkpoint.internal import is_committed
from tests.fault._launch import events, output, torchrun, torchrun_command
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

# One fault per attempt; every preemption commits preempt-step=<N> and torchrun restarts the group. Validation runs
# after every 4th step; the ranks agree synchronously there, and between validations at checks a second apart.
CHAIN = ";".join(
    [
        "signal_at:rank=1,step=0,sig=SIGTERM,attempt=0",  # one rank, during the very first step
        "storage_stall_at:rank=0,step=4,seconds=3,attempt=1",  # a slow background write ...
        "signal_at:rank=0,step=4,sig=SIGUSR1,during=write,attempt=1",  # ... and a signal while it runs
        "signal_at:rank=None,step=9,sig=SIGTERM,times=2,attempt=2",  # every rank, twice
        "signal_at:rank=1,step=13,sig=SIGTERM,during=validation,attempt=3",  # during validation
    ]
)


@pytest.mark.extended
def test_four_preemptions_in_a_row_each_commit_a_checkpoint_that_the_next_attempt_resumes(tmp_path):
    root = tmp_path / "run"
    proc = torchrun(
        "--root", str(root), "--max-steps", "20", "--faults", CHAIN, "--val-every", "4", "--grace", "25",
        max_restarts=4,
    )  # fmt: skip
    assert proc.returncode == 0, output(proc)
    preempt_steps = []
    for attempt in range(4):
        preempted = events(root, "preempted", attempt)
        assert sorted(e["rank"] for e in preempted) == [0, 1], output(proc)
        (path,) = {e["checkpoint_path"] for e in preempted}
        assert is_committed(path) and all(e["exit_code"] == 75 for e in preempted)
        assert all(e["time"] - e["signal_time"] < 25.0 for e in preempted)  # within grace_s
        ends = events(root, "attempt_end", attempt)
        assert {(e["rank"], e["reason"], e["exit_code"]) for e in ends} == {(0, "preempted", 75), (1, "preempted", 75)}
        (resumed,) = events(root, "resumed", attempt + 1)
        assert resumed["path"] == path
        preempt_steps.append(preempted[0]["step"])
        by_rank = {e["rank"]: e for e in preempted}
        if attempt == 0:
            assert preempted[0]["signal"] == "SIGTERM" and by_rank[0]["signal_ranks"] == [1]
            assert by_rank[1]["own_signal"] == "SIGTERM" and by_rank[0]["own_signal"] is None
        if attempt == 1:
            assert preempted[0]["signal"] == "SIGUSR1"
            commits = events(root, "checkpoint_committed", 1)
            stalled = next(e for e in commits if e["step"] == 4)
            last = next(e for e in commits if e["path"] == path)
            assert stalled["total_s"] >= 3.0 and stalled["time"] <= last["time"]  # the in-flight write finished first
        if attempt == 2:
            assert by_rank[0]["signal_ranks"] == [0, 1]
            assert by_rank[0]["signals_received"] == 2 and by_rank[1]["signals_received"] == 2
    # The first check reads the flag of the first step; the signal during the write is read after the validation of
    # step 4 or 8 at the latest; the one of step 10 by the validation of step 12; the one in the validation of step 16
    # right after it.
    assert preempt_steps[0] in (2, 3) and 4 <= preempt_steps[1] <= 8, preempt_steps
    assert 10 <= preempt_steps[2] <= 12 and preempt_steps[3] == 16, preempt_steps
    assert {(e["rank"], e["reason"]) for e in events(root, "attempt_end", 4)} == {(0, "finished"), (1, "finished")}
    assert json.loads((root / "done.json").read_text())["step"] == 20


def _fake_scontrol(tmp_path):
    record = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script.parent, record


def test_sigusr1_to_torchrun_under_slurm_checkpoints_every_rank_requeues_once_and_the_requeued_job_resumes(tmp_path):
    root = tmp_path / "run"
    bin_dir, record = _fake_scontrol(tmp_path)
    env = subprocess_env(SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cmd = torchrun_command(
        "--root", str(root), "--max-steps", "100000", "--grace", "25",
        torchrun_args=("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",),
    )  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and not any(e["step"] >= 4 for e in events(root, "progress")):
            assert proc.poll() is None, proc.communicate()[1][-5000:]
            time.sleep(0.5)
        sent = time.time()
        proc.send_signal(signal.SIGUSR1)  # what SLURM does ahead of the time limit (srun/sbatch --signal)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    exited_s = time.time() - sent
    assert proc.returncode != 0  # torchrun reports its own failure, not the workers' exit code
    preempted = events(root, "preempted")
    assert sorted(e["rank"] for e in preempted) == [0, 1], stderr[-5000:]
    assert all(e["signal"] == "SIGUSR1" and e["signal_ranks"] == [0, 1] for e in preempted)
    assert exited_s < 30.0  # inside torchrun's shutdown timeout
    assert record.read_text().splitlines() == ["requeue 4242"]  # once, by rank 0
    assert next(e for e in preempted if e["rank"] == 0)["slurm_requeued"] is True
    path = preempted[0]["checkpoint_path"]
    step = preempted[0]["step"]
    assert is_committed(path)

    again = torchrun("--root", str(root), "--max-steps", str(step + 2), env={"SLURM_JOB_ID": "4242"})
    assert again.returncode == 0, output(again)
    (resumed,) = events(root, "resumed", 1)
    assert resumed["path"] == path and resumed["step"] == step
    assert record.read_text().splitlines() == ["requeue 4242"]  # nothing more: no signal this time
