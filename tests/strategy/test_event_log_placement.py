"""Where a run's records go under a real Trainer: nothing beside the user's files in a plain one-process run (as
Lightning writes nothing with ``logger=False``), the event log on disk as soon as something will read it, and an
incident that writes what the attempt recorded so far."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_ft.checkpoint as lft_checkpoint
from lightning_ft import GoodputMonitor
from lightning_ft.events import get_event_log, read_events
from tests.checkpoint.support import flip_a_byte_of
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer


def _fit(root, *, callbacks=(), max_steps=4, **kwargs):
    as_a_new_process()  # each call stands for a launch
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(root, callbacks=[ckpt, *callbacks], max_steps=max_steps, **kwargs)
    trainer.fit(TinyRegressor())
    return trainer


def test_a_plain_run_with_dirpath_equal_to_default_root_dir_lists_only_its_checkpoints(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    trainer = _fit(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    lines = get_event_log(trainer, open_if_missing=False).lines()
    assert [e["step"] for e in lines if e["event"] == "checkpoint_committed"] == [2, 4]

    # A second launch over the same folder still resumes by itself, and still writes nothing else.
    again = _fit(tmp_path, max_steps=6)
    assert again.global_step == 6
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    (resumed,) = [e for e in get_event_log(again, open_if_missing=False).lines() if e["event"] == "resumed"]
    assert resumed["step"] == 4


def test_a_run_with_a_lightning_ft_monitor_keeps_its_event_log_on_disk(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    _fit(tmp_path, callbacks=[GoodputMonitor()])
    assert "lightning-ft" in os.listdir(tmp_path)
    events = [e["event"] for e in read_events(tmp_path)]
    assert events[0] == "attempt_start" and events.count("checkpoint_committed") == 2


def test_an_incident_in_a_plain_run_writes_the_attempt_so_far_for_report(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    _fit(tmp_path)
    newest = tmp_path / "epoch=0-step=4.ckpt"
    flip_a_byte_of(newest, lft_checkpoint.load_checkpoint(newest).state["state_dict"]["net.0.weight"])

    again = _fit(tmp_path, max_steps=6)  # falls back to step 2: a rejected checkpoint is an incident
    assert again.global_step == 6
    events = read_events(tmp_path)
    names = [e["event"] for e in events]
    assert names[0] == "attempt_start" and "checkpoint_rejected" in names  # the lines before it too
    assert {e["attempt"] for e in events} == {0}  # the first launch kept nothing: this is the run's first record
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2]


class _CrashesAtStep(TinyRegressor):
    """A bug in the user's code: ``training_step`` raises once the run reached ``step``."""

    def __init__(self, step: int | None) -> None:
        super().__init__()
        self.crash_step = step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.crash_step:
            raise RuntimeError(f"a bug in training_step at step {self.crash_step}")
        return super().training_step(batch, batch_idx)


def test_a_crash_of_user_code_in_a_plain_run_is_on_record_and_the_relaunch_is_a_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)
    from lightning_ft.monitors.goodput_report import summarize
    from lightning_ft.monitors.goodput_text import format_report

    def fit(model, max_steps):
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        # Lightning's default log_every_n_steps: the crash comes before any periodic progress line.
        trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=max_steps, log_every_n_steps=50)
        trainer.fit(model)
        return trainer

    with pytest.raises(RuntimeError, match="a bug in training_step at step 7"):
        fit(_CrashesAtStep(7), 10)
    events = read_events(tmp_path)  # written to disk by the crash, though the run kept its log in memory
    (end,) = [e for e in events if e["event"] == "attempt_end"]
    assert (end["attempt"], end["reason"], end["step"]) == (0, "crashed", 7)
    assert "RuntimeError: a bug in training_step at step 7" in end["error"]

    as_a_new_process()  # the relaunch
    again = fit(_CrashesAtStep(None), 10)  # the relaunch: resumes from step 6 and counts itself attempt 1
    assert again.global_step == 10
    events = read_events(tmp_path)
    assert sorted({e["attempt"] for e in events}) == [0, 1]
    summary = summarize(events)
    first, second = summary["attempts"]
    assert (first["end_reason"], first["last_step"], second["end_reason"]) == ("crashed", 7, "finished")
    assert first["productive_s"] > 0 and first["estimated_steps"] == 0  # steps 1..7 measured, written at the crash
    (restart,) = summary["restarts"]
    assert (restart["cause"], restart["resumed_step"], restart["lost_steps"], restart["failure"]) == (
        "crashed",
        6,
        1,
        True,
    )
    assert summary["totals"]["restarts"] == 1 and summary["totals"]["lost_steps"] == 1
    assert "restart before attempt 1 (after: crashed)" in format_report(summary)


@pytest.mark.parametrize("second", ["ddp", "elastic_ft3d"])
def test_a_plain_run_beside_another_experiments_records_adds_only_what_ddp_strategy_adds(tmp_path, monkeypatch, second):
    """An experiment that crashed left its records in the folder; the next experiment from that folder (its own
    checkpoint folder, a TensorBoard logger) is plain and ends normally: it adds what it adds under ``DDPStrategy``
    (its checkpoints and its logger's ``version_1``), no run folder, lock or logger-version record of its own."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ft import ElasticFT3D

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)

    def fit(model, folder, strategy):
        ckpt = ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=2)
        logger = TensorBoardLogger(tmp_path)
        trainer = make_trainer(tmp_path, strategy=strategy, callbacks=[ckpt], max_steps=4, logger=logger)
        trainer.fit(model)
        return trainer

    with pytest.raises(RuntimeError, match="a bug in training_step"):
        fit(_CrashesAtStep(3), "first", ElasticFT3D())
    assert read_events(tmp_path)  # the crash is on record
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}

    trainer = fit(TinyRegressor(), "second", DDPStrategy() if second == "ddp" else ElasticFT3D())
    added = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.relative_to(tmp_path) not in before)
    assert [p for p in added if "events.out.tfevents" not in p] == [
        "lightning_logs/version_1",
        "lightning_logs/version_1/hparams.yaml",
        "second",
        "second/epoch=0-step=4.ckpt",
    ]
    assert trainer.logger.version == 1


@pytest.mark.parametrize("relaunch", ["ddp", "elastic_ft3d"])
def test_a_plain_relaunch_after_a_crash_numbers_its_logger_version_as_ddp_strategy_does(
    tmp_path, monkeypatch, relaunch
):
    """A plain one-process run crashed (its records are on disk); its relaunch resumes and ends normally. Its
    TensorBoard version is the next one, as under ``DDPStrategy``, and it records no logger versions: only a launch
    that expects restarts (torchrun, a monitor, ...) keeps one version across attempts."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ft import ElasticFT3D

    monkeypatch.delenv("LIGHTNING_FT_RUN_ID", raising=False)

    def fit(model, strategy):
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
        trainer = make_trainer(
            tmp_path, strategy=strategy, callbacks=[ckpt], max_steps=6, logger=TensorBoardLogger(tmp_path)
        )
        trainer.fit(model)
        return trainer

    with pytest.raises(RuntimeError, match="a bug in training_step"):
        fit(_CrashesAtStep(3), ElasticFT3D())
    trainer = fit(TinyRegressor(), DDPStrategy() if relaunch == "ddp" else ElasticFT3D())
    assert trainer.logger.version == 1
    assert sorted(os.listdir(tmp_path / "lightning_logs")) == ["version_0", "version_1"]
    assert not (tmp_path / "lightning-ft" / "logger_versions.json").exists()
    if relaunch == "elastic_ft3d":  # the relaunch is on record as the run's next attempt, after the crash
        assert [e["attempt"] for e in read_events(tmp_path) if e["event"] == "attempt_end"] == [0, 1]
