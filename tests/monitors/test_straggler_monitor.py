from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.events import read_events
from lightning_ft.monitors import STRAGGLER_EXIT_CODE, StragglerMonitor
from tests.helpers import PYTHON, free_port, subprocess_env
from tests.monitors.tiny_module import TinyModule

JOB = os.path.join(os.path.dirname(__file__), "straggler_job.py")


def run_job(root: Path, *args: str, devices: int = 3) -> subprocess.CompletedProcess:
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [PYTHON, JOB, "--root", str(root), "--devices", str(devices), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)


def events(root: Path, name: str) -> list[dict]:
    return [e for e in read_events(root) if e["event"] == name]


def logged_columns(root: Path) -> set[str]:
    with open(root / "logs" / "version_0" / "metrics.csv") as f:
        return set(next(csv.reader(f)))


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["compute", "data"])
def test_the_rank_with_slower_compute_or_data_loading_is_named(tmp_path, cause):
    done = run_job(tmp_path, "--cause", cause, "--slow-rank", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    found = events(tmp_path, "straggler")
    assert found, done.stderr[-3000:]
    assert found[0]["suspect_rank"] == 1
    assert found[0]["ratio"] > 1.12
    assert {"straggler/own_ms/rank_1", "straggler/wait_ms/rank_0", "straggler/own_ms/median"} <= logged_columns(
        tmp_path
    )


@pytest.mark.slow
def test_a_throttled_device_is_reported_by_its_rank_and_that_rank_is_named(tmp_path):
    done = run_job(tmp_path, "--cause", "thermal", "--slow-rank", "1", "--delay-ms", "15")
    assert done.returncode == 0, done.stderr[-3000:]
    (thermal,) = events(tmp_path, "thermal")
    assert (thermal["rank"], thermal["device"], thermal["reasons"]) == (1, 1, ["HwThermalSlowdown"])
    found = events(tmp_path, "straggler")
    assert found and found[0]["suspect_rank"] == 1
    assert "thermal/temperature_c/rank_1" in logged_columns(tmp_path)


@pytest.mark.slow
def test_checkpoint_and_stop_saves_a_preempt_checkpoint_and_exits_with_the_restart_code(tmp_path):
    done = run_job(tmp_path, "--cause", "compute", "--slow-rank", "1", "--action", "checkpoint_and_stop", devices=2)
    assert done.returncode == STRAGGLER_EXIT_CODE, done.stderr[-3000:]
    (detection,) = events(tmp_path, "straggler")
    assert (tmp_path / "checkpoints" / f"preempt-step={detection['step']}").exists()


def test_on_one_device_without_a_process_group_its_times_are_logged_and_nobody_is_named(tmp_path):
    calls = []
    monitor = StragglerMonitor(interval=4, warmup_steps=2, action=lambda *a: calls.append(a))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name="logs", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(TinyModule(), DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=2))
    assert {"straggler/compute_ms/rank_0", "straggler/data_ms/rank_0", "straggler/step_ms/rank_0"} <= logged_columns(
        tmp_path
    )
    assert monitor.detections == [] and calls == []


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"action": "page_me"}, {"warmup_steps": -1}, {"patience": 0}])
def test_bad_options_are_rejected_naming_the_option(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        StragglerMonitor(**kwargs)
