"""validate/test/predict from snapshot folders ("best" and "last" too, in a fresh Trainer), and top-k by a metric."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft.checkpoint import list_committed, load_checkpoint
from lightning_ft.events import read_events
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

# Each test runs against every format; these runs read their event log, as a restarted run keeps it on disk.
pytestmark = pytest.mark.usefixtures("checkpoint_format", "event_log_on_disk")

SCORES = [5.0, 3.0, 4.0, 1.0, 2.0, 6.0, 0.5, 7.0]
"""The monitored value logged at each step: the checkpoint of step ``i + 1`` carries ``SCORES[i]``."""


class ScoredRegressor(TinyRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("score", SCORES[self.global_step])
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def val_dataloader(self):
        return self.train_dataloader()

    test_dataloader = predict_dataloader = val_dataloader


def _callback(tmp_path):
    return ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=2, monitor="score", mode="min", save_last=True
    )


def _fit(tmp_path, max_steps):
    as_a_new_process()  # each call stands for a launch
    trainer = make_trainer(tmp_path, callbacks=[_callback(tmp_path)], max_steps=max_steps, limit_val_batches=1)
    trainer.fit(ScoredRegressor())
    return trainer


def _steps_on_disk(tmp_path):
    return sorted(c.step for c in list_committed(tmp_path / "ckpt") if not c.path.name.startswith("last"))


def test_top_k_by_a_metric_keeps_the_best_snapshots_and_removes_the_worse_ones_across_restarts(tmp_path):
    _fit(tmp_path, 6)
    # Scores by step 1..6: 5, 3, 4, 1, 2, 6 -> the two lowest are steps 4 and 5.
    assert _steps_on_disk(tmp_path) == [4, 5]
    trainer = _fit(tmp_path, 8)  # auto-resumes at step 6 with the callback's top-k, then step 7 scores 0.5
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [6]
    assert _steps_on_disk(tmp_path) == [4, 7]
    assert trainer.checkpoint_callback.best_model_path.endswith("step=7.ckpt")
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if not p.is_symlink()]
    assert sorted(leftovers) in (
        ["epoch=0-step=4.ckpt", "epoch=0-step=7.ckpt", "last.ckpt.step=8.lft"],
        ["epoch=0-step=4.ckpt", "epoch=0-step=7.ckpt"],
        ["epoch=0-step=4.ckpt", "epoch=0-step=7.ckpt", "last.ckpt"],  # checkpoint files: `last` is a file of its own
    )


def _weights_of(path):
    return load_checkpoint(path).state["state_dict"]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_best_last_and_a_folder_load_for_evaluation_in_a_fresh_trainer(tmp_path, stage):
    trained = _fit(tmp_path, 6)
    best = trained.checkpoint_callback.best_model_path
    assert best.endswith("step=4.ckpt")
    for ckpt_path, expected in (
        ("best", best),
        ("last", (tmp_path / "ckpt" / "last.ckpt").resolve()),  # step 6, kept for `last` though not in the top 2
        (str(tmp_path / "ckpt" / "epoch=0-step=5.ckpt"), tmp_path / "ckpt" / "epoch=0-step=5.ckpt"),
    ):
        # A new Trainer and a new callback know nothing of the run that trained: as in a fresh process.
        trainer = make_trainer(
            tmp_path,
            callbacks=[_callback(tmp_path)],
            limit_val_batches=1,
            limit_test_batches=1,
            limit_predict_batches=1,
        )
        model = ScoredRegressor()
        getattr(trainer, stage)(model, ckpt_path=ckpt_path)
        for name, tensor in _weights_of(expected).items():
            assert torch.equal(model.state_dict()[name], tensor), (ckpt_path, name)
    # Evaluation never counts as a resume of training.
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == []
