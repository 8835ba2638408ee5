"""SLURM requeue: which job, when, and a real ``scontrol`` call (a fake one on the PATH records it)."""

from __future__ import annotations

import os
import signal
import stat

from lightning_ft.fault import slurm


def fake_scontrol(tmp_path, code: int = 0):
    record = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script.parent, record


def test_the_job_id_is_the_array_task_when_there_is_one():
    assert slurm.slurm_job_id({"SLURM_JOB_ID": "1234"}) == "1234"
    assert slurm.slurm_job_id({"SLURM_JOB_ID": "1240", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "6"}) == (
        "1234_6"
    )
    assert slurm.slurm_job_id({}) is None
    assert slurm.slurm_job_id({"SLURM_JOB_ID": "12; rm -rf /"}) is None


def test_only_the_requeue_signal_inside_a_slurm_job_requeues():
    env = {"SLURM_JOB_ID": "77"}
    assert slurm.should_requeue(signal.SIGUSR1, env)
    assert not slurm.should_requeue(signal.SIGTERM, env)  # scancel, or SLURM's own preemption
    assert not slurm.should_requeue(signal.SIGUSR1, {})
    assert not slurm.should_requeue(signal.SIGUSR1, {**env, "LIGHTNING_FT_SLURM_REQUEUE": "0"})


def test_requeue_runs_scontrol_requeue_with_the_job_id(tmp_path, monkeypatch):
    bin_dir, record = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert slurm.requeue({"SLURM_JOB_ID": "4242"})
    assert record.read_text().splitlines() == ["requeue 4242"]


def test_a_failing_scontrol_is_reported_not_raised(tmp_path, monkeypatch):
    bin_dir, record = fake_scontrol(tmp_path, code=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert not slurm.requeue({"SLURM_JOB_ID": "4242"})
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert not slurm.requeue({"SLURM_JOB_ID": "4242"})
