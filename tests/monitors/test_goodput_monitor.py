from __future__ import annotations

import csv
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.events import read_events
from lightning_ft.monitors import GoodputMonitor
from lightning_ft.monitors.goodput_report import summarize
from tests.monitors.tiny_module import TinyModule


def fit(root, monitor: GoodputMonitor, steps: int) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        logger=CSVLogger(root, name="logs", version=0),
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
    )
    trainer.fit(TinyModule(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2))
    return trainer


def test_one_attempt_writes_its_start_first_step_and_progress_and_logs_the_ratio(tmp_path):
    monitor = GoodputMonitor()
    fit(tmp_path, monitor, steps=10)
    names = [e["event"] for e in read_events(tmp_path)]
    assert names[:2] == ["attempt_start", "first_step"]
    assert names.count("progress") >= 2
    totals = monitor.totals()
    assert 0 < totals["ettr"] <= 1
    assert totals["productive_s"] > 0 and totals["attempts"] == 1
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        assert {"goodput/ettr", "goodput/device_utilisation", "goodput/restart_s"} <= set(next(csv.reader(f)))


def test_a_second_attempt_of_the_same_run_counts_the_first_one(tmp_path):
    fit(tmp_path, GoodputMonitor(), steps=10)
    second = GoodputMonitor()
    fit(tmp_path, second, steps=10)
    totals = second.totals()
    assert (totals["attempts"], totals["restarts"]) == (2, 1)
    assert totals["restart_s"] > 0
    summary = summarize(read_events(tmp_path))
    assert [a["attempt"] for a in summary["attempts"]] == [0, 1]
    # Without a checkpoint to resume from, the second attempt recomputed all 10 steps of the first.
    assert summary["restarts"][0]["lost_steps"] == 10
    assert totals["lost_steps"] == 10


def test_its_state_is_plain_json_and_restores_the_totals_when_no_event_log_is_left(tmp_path):
    first = GoodputMonitor()
    fit(tmp_path / "a", first, steps=6)
    state = json.loads(json.dumps(first.state_dict()))
    restored = GoodputMonitor()
    restored.load_state_dict(state)
    fit(tmp_path / "b", restored, steps=6)
    assert restored.totals()["productive_s"] > state["productive_s"]
    assert restored.totals()["attempts"] == 2


def test_a_non_positive_log_interval_is_rejected():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        GoodputMonitor(log_every_n_steps=0)
