"""The strategy's checkpoint I/O (strategy/checkpoint_io.py) as a Trainer user sees it: `last` holds the newest state
Lightning asked for (a link when a committed checkpoint of that step exists), retention keeps the newest, a bad
`dirpath` fails at set-up, and a save outside `fit` commits before it returns."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import AsyncCheckpointer, list_committed
from lightning_ft.checkpoint.internal import is_committed, read_metadata
from lightning_ft.events import read_events
from tests.checkpoint.support import checkpoint_format
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

# Each test runs against every format; these runs read their event log, as a restarted run keeps it on disk.
pytestmark = pytest.mark.usefixtures("checkpoint_format", "event_log_on_disk")


class _MonitoredRegressor(TinyRegressor):
    """Logs a metric that stops improving after step 2, so top-k keeps step 2 while training goes on."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("score", float(min(self.global_step, 2)))  # logged before the step counter moves: 0, 1, 2, 2, ...
        return loss


def _fit(tmp_path, max_steps, *, model=None, ckpt_path=None, callbacks=None, **ckpt_kwargs):
    as_a_new_process()  # each call stands for a launch
    callbacks = callbacks if callbacks is not None else [ModelCheckpoint(dirpath=tmp_path / "ckpt", **ckpt_kwargs)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=max_steps)
    model = model or TinyRegressor()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def test_last_holds_the_newest_state_when_top_k_keeps_an_older_one(tmp_path):
    trainer, model = _fit(
        tmp_path,
        6,
        model=_MonitoredRegressor(),
        every_n_train_steps=1,
        save_top_k=1,
        monitor="score",
        mode="max",
        save_last=True,
    )
    last = tmp_path / "ckpt" / "last.ckpt"
    assert not last.is_symlink() and is_committed(last)  # a checkpoint of its own, as Lightning writes it
    assert read_metadata(last)["step"] == 6
    # Resuming from "last" continues at step 6, not at the best (older) checkpoint.
    trainer2, model2 = _fit(
        tmp_path,
        6,
        model=_MonitoredRegressor(),
        ckpt_path="last",
        every_n_train_steps=1,
        save_top_k=1,
        monitor="score",
        mode="max",
        save_last=True,
    )
    assert trainer2.global_step == 6
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
    # Superseded copies of `last` were cleaned up: one for the newest step at most, besides top-k's.
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".lft")]
    assert len(leftovers) <= 1, leftovers


def test_save_last_without_top_k_still_saves_a_resumable_state(tmp_path):
    _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=0, save_last=True)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert not last.is_symlink() and is_committed(last)
    assert read_metadata(last)["step"] == 4
    trainer2, _ = _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=0, save_last=True)  # auto-resume finds it
    assert trainer2.global_step == 4
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]


def test_an_explicit_save_to_last_ckpt_is_written(tmp_path):
    trainer, model = _fit(tmp_path, 3, every_n_train_steps=100)
    trainer.save_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    last = tmp_path / "ckpt" / "last.ckpt"
    assert is_committed(last.resolve()) and read_metadata(last.resolve())["step"] == 3


def test_a_trainer_can_be_pickled_and_deep_copied_and_a_trained_model_saved_whole(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")], max_steps=2)
    clone = pickle.loads(pickle.dumps(trainer))
    assert isinstance(clone.strategy, ElasticFT3D)
    copy.deepcopy(trainer)
    model = TinyRegressor()
    trainer.fit(model)
    # After fit the strategy holds a writer, its locks and an open event log: none of it travels.
    clone = pickle.loads(pickle.dumps(trainer.strategy))
    assert clone.event_log is None and clone._checkpoints is None
    copy.deepcopy(trainer.strategy)
    torch.save(model, tmp_path / "model.pt")
    assert isinstance(torch.load(tmp_path / "model.pt", weights_only=False), TinyRegressor)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_a_missing_ckpt_path_outside_fit_is_a_file_not_found_error(tmp_path, stage):
    class _Eval(TinyRegressor):
        def validation_step(self, batch, batch_idx):
            return None

        def test_step(self, batch, batch_idx):
            return None

        def predict_step(self, batch, batch_idx):
            return batch[0]

        def val_dataloader(self):
            return self.train_dataloader()

        test_dataloader = predict_dataloader = val_dataloader

    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        getattr(trainer, stage)(_Eval(), ckpt_path=str(tmp_path / "nope.ckpt"))


def test_remove_checkpoint_works_before_the_strategy_is_set_up_and_keeps_the_newest(tmp_path):
    # ModelCheckpoint can ask for a removal outside a run (Lightning's own tests do); nothing is left undone.
    for step in (1, 2):
        writer = AsyncCheckpointer()
        writer.save(tmp_path / f"step={step}", {"w": torch.ones(2)}, metadata={"step": step})
        writer.close()
    strategy = ElasticFT3D()
    strategy.remove_checkpoint(tmp_path / "step=1")
    strategy.remove_checkpoint(tmp_path / "step=2")
    assert not (tmp_path / "step=1").exists()
    assert is_committed(tmp_path / "step=2"), "the newest committed checkpoint was deleted"


def test_save_last_writes_last_as_a_checkpoint_of_its_own_that_no_write_to_another_path_reaches(tmp_path):
    # Lightning writes `last` with a torch.save of its own: here it is written from the capture of the top-k save of
    # the same step (no second capture), as a file or folder of its own (no link, no hard link).
    _fit(tmp_path, 6, every_n_train_steps=2, save_top_k=-1, save_last=True)
    folder = tmp_path / "ckpt"
    last, step6 = folder / "last.ckpt", folder / "epoch=0-step=6.ckpt"
    assert not last.is_symlink() and is_committed(last) and read_metadata(last)["step"] == 6
    assert not os.path.samefile(last, step6)
    if checkpoint_format() == "file":
        assert last.stat().st_ino != step6.stat().st_ino
    assert sorted(p.name for p in folder.iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]


def test_save_top_k_keeps_the_newest_committed_checkpoints_only(tmp_path):
    _fit(tmp_path, 8, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max")
    steps = [c.step for c in list_committed(tmp_path / "ckpt")]
    assert steps == [6, 8]


def test_unwritable_checkpoint_directory_fails_at_setup_naming_the_path(tmp_path):
    # /sys refuses new files even to root, so this holds for any user CI runs as.
    ckpt = ModelCheckpoint(dirpath="/sys/lightning_ft_ckpt", every_n_train_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=1)
    with pytest.raises(ValueError, match=r"dirpath='/sys/lightning_ft_ckpt'.*cannot write into '/sys'"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0


def test_checkpoint_directory_with_missing_parents_is_created_by_the_first_save(tmp_path):
    # As under DDPStrategy (its checkpoint I/O makes every missing folder): invariant 2.
    dirpath = tmp_path / "not" / "yet" / "ckpt"
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1)
    trainer = make_trainer(tmp_path / "root" / "missing", callbacks=[ckpt], max_steps=1)
    trainer.fit(TinyRegressor())
    assert is_committed(dirpath / "epoch=0-step=1.ckpt")


def test_checkpoint_directory_below_a_file_fails_at_setup_naming_it(tmp_path):
    (tmp_path / "a_file").write_text("")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a_file" / "ckpt", every_n_train_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=1)
    with pytest.raises(ValueError, match=r"a_file' exists and is not a folder"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0


def test_trainer_save_checkpoint_after_fit_writes_a_committed_checkpoint_that_resumes(tmp_path):
    trainer, model = _fit(tmp_path, 3, every_n_train_steps=100)
    final = tmp_path / "ckpt" / "final.ckpt"
    trainer.save_checkpoint(final)
    assert is_committed(final)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=100)
    trainer2 = make_trainer(tmp_path, callbacks=[ckpt], max_steps=3)
    model2 = TinyRegressor()
    trainer2.fit(model2, ckpt_path=str(final))
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
