"""Two experiments started one after the other from one working folder are two runs (issue 30): each has its own run
id and event log, a relaunch of either continues its own run (its next attempt), and ``lightning-ft report`` names
both. The key is the run's checkpoint folders (``ModelCheckpoint(dirpath=...)``), recorded in its ``run.json``.

Real Trainer runs in one process, event log on disk; the runs started while another is live (two processes) are in
tests/core/test_events.py and tests/e2e/test_resume_identity.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lightning_ft import ElasticFT3D, GoodputMonitor
from lightning_ft.cli import main
from lightning_ft.events import concurrent_runs, get_event_log, read_events
from tests.helpers import as_a_new_process, subprocess_env
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def _launch(
    root: Path,
    ckpt: str,
    *,
    max_steps: int,
    crash: int | None = None,
    extra: tuple[Callback, ...] = (),
    strategy_override: Any = None,
    **kwargs: Any,
) -> L.Trainer:
    """One launch of an experiment (what ``python train.py`` does): a new Trainer, checkpoints every 2 steps in
    ``root/ckpt``."""
    as_a_new_process()
    L.seed_everything(0)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=root / ckpt, every_n_train_steps=2, save_top_k=-1)]
    callbacks.extend(extra)
    if crash is not None:
        callbacks.append(CrashAt(crash))
    strategy = strategy_override if strategy_override is not None else ElasticFT3D()
    trainer = make_trainer(root, strategy=strategy, callbacks=callbacks, max_steps=max_steps, **kwargs)
    if crash is None:
        trainer.fit(TinyRegressor())
    else:
        with pytest.raises(RuntimeError, match="crash at step"):
            trainer.fit(TinyRegressor())
    return trainer


class MetricsKept(Logger):
    """Keeps what is logged, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "kept"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step or 0, dict(metrics)))


def _replayed(ckpt: str, root: Path, *, crash: int | None = None) -> list[tuple[int, float]]:
    """``goodput/replayed_steps`` as ``GoodputMonitor`` logs it in one launch: the steps an earlier attempt of this
    run trained past the checkpoint this one resumed (read from this run's records)."""
    logger = MetricsKept()
    _launch(root, ckpt, max_steps=6, crash=crash, extra=[GoodputMonitor(log_every_n_steps=1)], logger=logger)
    return [(step, m["goodput/replayed_steps"]) for step, m in logger.metrics if "goodput/replayed_steps" in m]


def test_goodput_monitor_counts_the_replayed_steps_of_its_own_run_only(tmp_path):
    """A crashes at step 3 (checkpoint at 2), B at step 5 (checkpoint at 4). B's relaunch replays step 5, A's step 3:
    each monitor reads its own run's earlier attempts, not the other experiment's."""
    assert _replayed("ckpt-a", tmp_path, crash=3) == []
    assert _replayed("ckpt-b", tmp_path, crash=5) == []
    assert _replayed("ckpt-b", tmp_path) == [(6, 1.0)]
    assert _replayed("ckpt-a", tmp_path) == [(4, 1.0)]


def _ids(trainer: L.Trainer) -> tuple[str, int]:
    log = get_event_log(trainer, open_if_missing=False)
    assert log is not None
    return log.run_id, log.attempt


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("rank*.jsonl"))}


def _starts(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["run_id"], e["attempt"]) for e in events if e["event"] == "attempt_start"]


def test_a_second_experiment_from_the_same_folder_is_another_run_and_each_relaunch_continues_its_own(tmp_path, capsys):
    """A (``ckpt-a``) crashes at step 3; B (``ckpt-b``) starts from the same folder: its own run id, attempt 0, its
    own event log under ``lightning-ft/runs/<id>``, A's log untouched. B crashes and is relaunched: attempt 1 of B,
    resuming B's checkpoint. A is relaunched: attempt 1 of A, resuming A's. The report of the folder names B's run."""
    a_run, a_attempt = _ids(_launch(tmp_path, "ckpt-a", max_steps=6, crash=3))
    assert a_attempt == 0
    a_log = _files(tmp_path / "lightning-ft" / "events")
    assert json.loads((tmp_path / "lightning-ft" / "run.json").read_text())["checkpoint_dirpaths"] == [
        str(tmp_path / "ckpt-a")
    ]

    b_run, b_attempt = _ids(_launch(tmp_path, "ckpt-b", max_steps=6, crash=5))
    assert b_run != a_run and b_attempt == 0
    assert _files(tmp_path / "lightning-ft" / "events") == a_log  # nothing of B in A's log
    (b_folder,) = concurrent_runs(tmp_path)
    assert b_folder == tmp_path / "lightning-ft" / "runs" / b_run
    assert json.loads((b_folder / "run.json").read_text())["checkpoint_dirpaths"] == [str(tmp_path / "ckpt-b")]
    b_events = read_events(b_folder)
    assert _starts(b_events) == [(b_run, 0)]
    assert not [e for e in b_events if e["event"] == "resumed"]  # B trained from scratch

    relaunched_b = _launch(tmp_path, "ckpt-b", max_steps=6)
    assert _ids(relaunched_b) == (b_run, 1) and relaunched_b.global_step == 6
    assert _files(tmp_path / "lightning-ft" / "events") == a_log
    b_events = read_events(b_folder)
    assert _starts(b_events) == [(b_run, 0), (b_run, 1)]
    (resumed,) = [e for e in b_events if e["event"] == "resumed"]
    assert resumed["attempt"] == 1 and resumed["step"] == 4 and "ckpt-b" in resumed["path"]
    # B's attempt ended: a launch of B from another process while this one lives continues B (its lock is free).
    code = "import sys; from lightning_ft.events import claim_run_dir; print(claim_run_dir(sys.argv[1]))"
    other = subprocess.run([sys.executable, "-c", code, str(b_folder)], env=subprocess_env(), capture_output=True)
    assert other.stdout.decode().strip() == "True"

    relaunched_a = _launch(tmp_path, "ckpt-a", max_steps=6)
    assert _ids(relaunched_a) == (a_run, 1) and relaunched_a.global_step == 6
    a_events = read_events(tmp_path)
    assert _starts(a_events) == [(a_run, 0), (a_run, 1)]
    (resumed,) = [e for e in a_events if e["event"] == "resumed"]
    assert resumed["attempt"] == 1 and resumed["step"] == 2 and "ckpt-a" in resumed["path"]
    assert concurrent_runs(tmp_path) == [b_folder]

    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert [a["attempt"] for a in json.loads(captured.out)["attempts"]] == [0, 1]  # A's two attempts, none of B's
    assert f"lightning-ft report {b_folder}" in captured.err
    assert main(["report", str(b_folder), "--json"]) == 0
    b_summary = json.loads(capsys.readouterr().out)
    assert b_summary["run_id"] == b_run and [a["attempt"] for a in b_summary["attempts"]] == [0, 1]


def test_each_experiment_keeps_its_own_tensorboard_version_across_its_relaunches(tmp_path):
    """The logger-version record is kept per run: A gets ``version_0``, B the next free one, and a relaunch of either
    writes to its own folder again."""
    from lightning.pytorch.loggers import TensorBoardLogger

    def version(ckpt: str) -> int:
        trainer = _launch(tmp_path, ckpt, max_steps=2, logger=TensorBoardLogger(tmp_path / "tb"))
        return trainer.logger.version

    assert [version("ckpt-a"), version("ckpt-b"), version("ckpt-b"), version("ckpt-a")] == [0, 1, 1, 0]
    assert sorted(p.name for p in (tmp_path / "tb" / "lightning_logs").iterdir()) == ["version_0", "version_1"]


def test_a_run_without_an_explicit_checkpoint_folder_is_the_folder_s_run_as_before(tmp_path):
    """No ``ModelCheckpoint(dirpath=...)``: nothing tells the experiments apart, so a launch is the folder's run (its
    next attempt), as in earlier releases. Lightning's default ``ModelCheckpoint`` takes its folder in its ``setup``,
    after the event log opened: that folder (which changes with the logger's version) is no key."""
    first = _ids(_launch(tmp_path, "ckpt-a", max_steps=2))
    for attempt, checkpointing in ((1, True), (2, False)):
        L.seed_everything(0)
        trainer = make_trainer(tmp_path, strategy=ElasticFT3D(), max_steps=2, enable_checkpointing=checkpointing)
        trainer.fit(TinyRegressor())
        assert _ids(trainer) == (first[0], attempt)
        assert [cb.dirpath for cb in trainer.checkpoint_callbacks] == ([str(tmp_path / "checkpoints")] * checkpointing)
    assert concurrent_runs(tmp_path) == []


def test_under_ddp_strategy_the_monitor_s_event_log_follows_the_same_runs(tmp_path):
    """Under ``DDPStrategy`` ``GoodputMonitor`` opens the log (at its ``setup``, before ``ModelCheckpoint``'s): the
    same key, the same runs."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    def launch(ckpt: str) -> tuple[str, int]:
        trainer = _launch(tmp_path, ckpt, max_steps=2, extra=(GoodputMonitor(),), strategy_override=DDPStrategy())
        if dist.is_initialized():
            dist.destroy_process_group()  # DDPStrategy leaves its group of one process up
        return _ids(trainer)

    (a_run, a0), (b_run, b0), (b_again, b1), (a_again, a1) = [
        launch(c) for c in ("ckpt-a", "ckpt-b", "ckpt-b", "ckpt-a")
    ]
    assert a_run != b_run and (a0, b0) == (0, 0)
    assert (b_again, b1) == (b_run, 1) and (a_again, a1) == (a_run, 1)
