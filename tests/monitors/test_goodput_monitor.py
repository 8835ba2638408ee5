from __future__ import annotations

import csv
import json

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.events import read_events
from lightning_ft.monitors import GoodputMonitor
from lightning_ft.monitors.goodput_report import summarize
from tests.monitors.tiny_module import TinyModule


class CrashAt(Callback):
    """The real fault: the training loop raises after ``step`` steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("injected crash")


def fit(
    root,
    monitor: GoodputMonitor,
    steps: int,
    *,
    version: int = 0,
    crash_at: int | None = None,
    log_every_n_steps: int = 5,
) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        logger=CSVLogger(root, name="logs", version=version),
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor] + ([CrashAt(crash_at)] if crash_at is not None else []),
    )
    trainer.fit(TinyModule(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2))
    return trainer


def logged(root, version: int) -> list[dict[str, str]]:
    with open(root / "logs" / f"version_{version}" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_one_attempt_writes_its_start_first_step_progress_and_end_and_logs_the_ratio(tmp_path):
    monitor = GoodputMonitor()
    fit(tmp_path, monitor, steps=10)
    names = [e["event"] for e in read_events(tmp_path)]
    assert names[:2] == ["attempt_start", "first_step"]
    assert names.count("progress") >= 2
    assert names[-1] == "attempt_end"
    assert summarize(read_events(tmp_path))["attempts"][0]["end_reason"] == "finished"
    totals = monitor.totals()
    assert 0 < totals["ettr"] <= 1
    assert totals["productive_s"] > 0 and totals["attempts"] == 1
    assert {"goodput/ettr", "goodput/device_utilisation", "goodput/restart_s"} <= set(logged(tmp_path, 0)[0])


def test_an_attempt_after_a_crash_is_a_restart_that_recomputes_the_lost_steps(tmp_path):
    with pytest.raises(RuntimeError, match="injected crash"):
        fit(tmp_path, GoodputMonitor(), steps=20, crash_at=10)
    second = GoodputMonitor()
    fit(tmp_path, second, steps=10, version=1)
    summary = summarize(read_events(tmp_path))
    assert [a["end_reason"] for a in summary["attempts"]] == ["crashed", "finished"]
    # Without a checkpoint to resume from, the second attempt recomputed all 10 steps of the first.
    assert summary["restarts"][0]["lost_steps"] == 10
    totals = second.totals()
    assert (totals["attempts"], totals["restarts"], totals["continuations"]) == (2, 1, 0)
    assert totals["restart_s"] > 0 and totals["lost_steps"] == 10


def test_launching_a_finished_run_again_is_a_continuation_in_the_live_totals(tmp_path):
    fit(tmp_path, GoodputMonitor(), steps=10)
    second = GoodputMonitor()
    fit(tmp_path, second, steps=10, version=1)
    totals = second.totals()
    assert (totals["attempts"], totals["restarts"], totals["continuations"]) == (2, 0, 1)
    assert (totals["restart_s"], totals["recovery_s"], totals["lost_steps"]) == (0.0, 0.0, 0.0)
    assert summarize(read_events(tmp_path))["restarts"] == []


def test_steps_an_earlier_attempt_reached_are_not_logged_again_and_the_replay_is_marked(tmp_path):
    with pytest.raises(RuntimeError, match="injected crash"):
        fit(tmp_path, GoodputMonitor(), steps=20, crash_at=10)
    assert [int(r["step"]) for r in logged(tmp_path, 0) if r.get("goodput/ettr")] == [5, 10]
    fit(tmp_path, GoodputMonitor(), steps=20, version=1)
    rows = [r for r in logged(tmp_path, 1) if r.get("goodput/ettr")]
    # Steps 1..10 were trained again from scratch: logged by the first attempt only.
    assert [int(r["step"]) for r in rows] == [15, 20]
    assert float(rows[0]["goodput/replayed_steps"]) == 10.0
    assert not rows[1].get("goodput/replayed_steps")


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


def test_a_run_shorter_than_two_log_intervals_still_logs_its_last_step(tmp_path):
    # Lightning's default log_every_n_steps=50 in a 78-step run: a point at step 50, and one at the end (step 78).
    fit(tmp_path, GoodputMonitor(), steps=78, log_every_n_steps=50)
    assert [int(r["step"]) for r in logged(tmp_path, 0) if r.get("goodput/ettr")] == [50, 78]


def test_a_slow_run_logs_at_least_every_log_every_s_seconds(tmp_path, monkeypatch):
    import lightning_ft.monitors.goodput_monitor as goodput_monitor

    monkeypatch.setattr(goodput_monitor, "LOG_EVERY_S", 0.0)  # every step is overdue
    fit(tmp_path, GoodputMonitor(), steps=6, log_every_n_steps=50)
    assert [int(r["step"]) for r in logged(tmp_path, 0) if r.get("goodput/ettr")] == [1, 2, 3, 4, 5, 6]


def test_its_progress_lines_come_at_least_every_progress_every_s(tmp_path, monkeypatch):
    import lightning_ft.monitors.goodput_monitor as goodput_monitor

    monkeypatch.setattr(goodput_monitor, "PROGRESS_EVERY_S", 0.0)
    fit(tmp_path, GoodputMonitor(), steps=6, log_every_n_steps=50)
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "progress"] == [1, 2, 3, 4, 5, 6]
    # The totals are logged at the last step only: a line in the event log is not a point in the logger.
    assert [int(r["step"]) for r in logged(tmp_path, 0) if r.get("goodput/ettr")] == [6]


def test_a_crash_before_the_first_progress_line_still_records_the_steps_trained(tmp_path):
    # log_every_n_steps=50 and a crash after 12 steps: the monitor writes what it measured before attempt_end.
    with pytest.raises(RuntimeError, match="injected crash"):
        fit(tmp_path, GoodputMonitor(), steps=40, crash_at=12, log_every_n_steps=50)
    events = read_events(tmp_path)
    (progress,) = [e for e in events if e["event"] == "progress"]
    assert progress["step"] == 12 and progress["productive_s"] > 0
    assert [e["event"] for e in events][-2:] == ["progress", "attempt_end"]
    (attempt,) = summarize(events)["attempts"]
    assert attempt["productive_s"] == progress["productive_s"] and attempt["estimated_steps"] == 0
