"""The strategy's per-batch callback (strategy/tracker.py): the progress events of every attempt, and the RNG states
of a resumed run set at its first batch, so the resumed run draws what an uninterrupted one draws."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft.events import read_events
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log


def _fit(tmp_path, max_steps, *, model=None, **ckpt_kwargs):
    as_a_new_process()  # each call stands for a launch
    trainer = make_trainer(
        tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", **ckpt_kwargs)], max_steps=max_steps
    )
    trainer.fit(model or TinyRegressor())
    return trainer


class _DrawingRegressor(TinyRegressor):
    """Records one draw of torch's global RNG per training step, as dropout or augmentation would make."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.draws.append(torch.rand(()).item())
        return super().training_step(batch, batch_idx)


def test_every_event_line_carries_the_contract_fields(tmp_path):
    _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path, 6, every_n_train_steps=2, save_top_k=-1)
    events = read_events(tmp_path)
    for e in events:
        assert {"time", "run_id", "attempt", "rank", "event", "step"} <= e.keys()
    assert len({e["run_id"] for e in events}) == 1
    starts = [e for e in events if e["event"] == "attempt_start"]
    assert [e["attempt"] for e in starts] == [0, 1]
    assert all(e["world_size"] == 1 and e["step"] is None for e in starts)
    commits = [e for e in events if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in commits] == [2, 4, 6]
    assert all(e["size_bytes"] > 0 and 0 <= e["stall_s"] <= e["total_s"] for e in commits)
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(e["productive_s"] >= 0 and e["data_wait_s"] >= 0 for e in progress)


def test_a_resumed_run_draws_the_random_numbers_an_uninterrupted_run_draws(tmp_path):
    torch.manual_seed(0)
    uninterrupted = _DrawingRegressor()
    _fit(tmp_path / "one", 4, model=uninterrupted)

    torch.manual_seed(0)
    _fit(tmp_path / "two", 2, model=_DrawingRegressor(), every_n_train_steps=2)
    torch.manual_seed(1)  # whatever the process drew in between, the resume puts the saved states back
    resumed = _DrawingRegressor()
    _fit(tmp_path / "two", 4, model=resumed, every_n_train_steps=2)
    assert resumed.draws == uninterrupted.draws[2:]


class _SlowRegressor(TinyRegressor):
    """Each training step takes at least ``step_s`` seconds."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import time

        time.sleep(self.step_s)
        return super().training_step(batch, batch_idx)


def test_a_progress_line_comes_at_least_every_progress_every_s_whatever_log_every_n_steps(tmp_path, monkeypatch):
    import lightning_ft.strategy.tracker as tracker

    monkeypatch.setattr(tracker, "PROGRESS_EVERY_S", 0.12)
    trainer = make_trainer(tmp_path, max_steps=12, log_every_n_steps=50)
    trainer.fit(_SlowRegressor(step_s=0.05))
    progress = [e for e in read_events(tmp_path) if e["event"] == "progress"]
    # A line every 3 steps or so (0.12 s at 0.05 s a step, and the loop's own time), the last one at the end.
    assert 3 <= len(progress) <= 7 and progress[-1]["step"] == 12
    assert sum(e["productive_s"] for e in progress) >= 12 * 0.05


def test_a_failed_fit_writes_the_steps_since_the_last_progress_line_before_its_end(tmp_path):
    class Crash(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 7:
                raise RuntimeError("a bug in training_step")
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, max_steps=20, log_every_n_steps=5)
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        trainer.fit(Crash())
    events = [e for e in read_events(tmp_path) if e["rank"] == 0]
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("progress", "attempt_end")] == [
        ("progress", 5),
        ("progress", 7),  # steps 6 and 7, written at the exception
        ("attempt_end", 7),
    ]


_HANG_SCRIPT = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_ft import FaultPolicy, ElasticFT3D
from tests.strategy.models import RandomVectors, TinyRegressor, make_trainer

class StopsAtItem(Dataset):
    # The data read of a batch that holds item 28 never returns.
    def __init__(self):
        self.inner = RandomVectors()
    def __len__(self):
        return len(self.inner)
    def __getitem__(self, i):
        if i == 28:
            time.sleep(3600)
        return self.inner[i]

class Model(TinyRegressor):
    def train_dataloader(self):
        return DataLoader(StopsAtItem(), batch_size=4)

strategy = ElasticFT3D(fault=FaultPolicy(hang_timeout_s=2.0, first_step_timeout_s=120.0, health_checks=False))
trainer = make_trainer(sys.argv[1], strategy=strategy, max_steps=20, log_every_n_steps=50)
trainer.fit(Model())
"""


@pytest.mark.slow
def test_a_hang_records_the_steps_its_stuck_main_thread_trained_before_the_watchdog_ends_it(tmp_path):
    import subprocess
    import sys

    from lightning_ft.fault.internal import HANG_EXIT_CODE
    from lightning_ft.monitors.goodput_report import summarize
    from tests.helpers import REPO_ROOT, subprocess_env

    done = subprocess.run(
        [sys.executable, "-c", _HANG_SCRIPT, str(tmp_path)],
        cwd=REPO_ROOT,
        env=subprocess_env(LIGHTNING_FT_EVENT_LOG="always"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == HANG_EXIT_CODE, done.stderr[-3000:]
    events = read_events(tmp_path)
    # No periodic line (log_every_n_steps=50): the watchdog's thread wrote one for the steps trained, before the hang.
    lines = [(e["event"], e["step"]) for e in events if e["event"] in ("progress", "hang", "attempt_end")]
    stuck_at = lines[0][1]
    assert stuck_at > 0 and lines == [("progress", stuck_at), ("hang", stuck_at), ("attempt_end", stuck_at)]
    (attempt,) = summarize(events)["attempts"]
    assert attempt["end_reason"] == "hung" and attempt["estimated_steps"] == 0 and attempt["productive_s"] > 0


_KILL_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import lightning_ft.strategy.tracker as tracker
tracker.PROGRESS_EVERY_S = 0.25  # 10 s in a real run; a test's steps are short
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer
from tests.helpers import as_a_new_process

root, kill_at = Path(sys.argv[1]), int(sys.argv[2])

class Slow(TinyRegressor):
    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)

class Kill(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=20, save_top_k=-1)
trainer = make_trainer(root, callbacks=[ckpt, Kill()], max_steps=60, log_every_n_steps=50)
trainer.fit(Slow())
"""


@pytest.mark.slow
def test_an_attempt_sigkilled_before_its_first_periodic_progress_line_is_counted_at_its_step_time(tmp_path):
    # Lightning's default log_every_n_steps=50 and a SIGKILL after step 45: the time-based progress lines (and the
    # report's estimate for the steps after the last one) account for the 45 steps, not "productive 0.0s".
    import subprocess
    import sys

    from lightning_ft.monitors.goodput_report import summarize
    from tests.helpers import REPO_ROOT, subprocess_env

    def launch(kill_at: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), str(kill_at)],
            cwd=REPO_ROOT,
            env=subprocess_env(LIGHTNING_FT_EVENT_LOG="always"),
            capture_output=True,
            text=True,
            timeout=300,
        )

    killed = launch(45)
    assert killed.returncode == -9, killed.stderr[-3000:]
    finished = launch(-1)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = summarize(read_events(tmp_path))
    first, second = summary["attempts"]
    assert (first["end_reason"], second["end_reason"], second["start_step"]) == ("killed", "finished", 40)
    # Its last record: step 40's checkpoint, or a time-based progress line after it.
    assert 40 <= first["last_step"] <= 45
    progress = [e for e in read_events(tmp_path) if e["event"] == "progress" and e["attempt"] == 0]
    assert len(progress) >= 2 and progress[-1]["step"] + first["estimated_steps"] == first["last_step"]
    # Every step slept 0.02 s inside training_step: the steps it recorded, at least that long each.
    assert first["productive_s"] >= first["last_step"] * 0.02
    (restart,) = summary["restarts"]
    assert restart["lost_steps"] == first["last_step"] - 40
