"""What a Trainer user sees of ElasticFT3D's checkpoints across fits: auto-resume (the newest *full* committed state,
on every rank alike), bad and refused paths, the logger version, exact weights after a resume."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import AsyncCheckpointer, CheckpointError, list_committed, load_checkpoint
from lightning_ft.checkpoint.internal import IN_PROGRESS_RECORD
from lightning_ft.events import read_events
from tests.checkpoint.support import flip_a_byte_of
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

# Each test runs against every format; these runs read their event log, as a restarted run keeps it on disk.
pytestmark = pytest.mark.usefixtures("checkpoint_format", "event_log_on_disk")


def _fit(tmp_path, max_steps, *, ckpt_path=None, strategy=None, callbacks=None, **ckpt_kwargs):
    as_a_new_process()  # each call stands for a launch
    callbacks = callbacks if callbacks is not None else [ModelCheckpoint(dirpath=tmp_path / "ckpt", **ckpt_kwargs)]
    trainer = make_trainer(tmp_path, strategy=strategy, callbacks=callbacks, max_steps=max_steps)
    model = TinyRegressor()
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def test_fit_without_ckpt_path_resumes_from_the_highest_committed_step(tmp_path):
    _fit(tmp_path, 6, every_n_train_steps=2, save_top_k=-1)
    # Uncommitted leftovers with a higher step must be ignored; the one lightning-ft can prove it wrote (its
    # in-progress record) is cleaned up, the other is left alone.
    leftover = tmp_path / "ckpt" / "epoch=0-step=99.ckpt"
    leftover.mkdir()
    (leftover / "batched").mkdir()
    (leftover / IN_PROGRESS_RECORD).write_text('{"step": 99}')
    unproven = tmp_path / "ckpt" / "epoch=0-step=98.ckpt"
    unproven.mkdir()
    (unproven / "batched").mkdir()
    trainer, _ = _fit(tmp_path, 8, every_n_train_steps=2, save_top_k=-1)
    assert trainer.global_step == 8
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [6]
    assert not leftover.exists()
    assert (unproven / "batched").is_dir()


def test_auto_resume_skips_a_corrupt_newest_checkpoint_and_logs_the_rejection(tmp_path):
    _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1)
    newest = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    flip_a_byte_of(newest, load_checkpoint(newest).state["state_dict"]["net.0.weight"])
    trainer, _ = _fit(tmp_path, 6, every_n_train_steps=2, save_top_k=-1)
    events = read_events(tmp_path)
    rejected = [e for e in events if e["event"] == "checkpoint_rejected"]
    assert len(rejected) == 1 and rejected[0]["path"].endswith("step=4.ckpt") and rejected[0]["reason"]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2]
    assert trainer.global_step == 6


def test_auto_resume_can_be_turned_off(tmp_path):
    _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1)
    trainer, _ = _fit(tmp_path, 2, strategy=ElasticFT3D(auto_resume=False), every_n_train_steps=2, save_top_k=-1)
    assert not [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert trainer.global_step == 2


def test_explicit_ckpt_path_accepts_a_checkpoint_directory_and_last(tmp_path):
    _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer, _ = _fit(tmp_path, 5, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"), every_n_train_steps=2)
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [2]
    trainer, _ = _fit(tmp_path, 6, ckpt_path="last", every_n_train_steps=2, save_top_k=-1, save_last=True)
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"][-1] == 4


def test_missing_ckpt_path_names_the_newest_committed_alternative(tmp_path):
    _fit(tmp_path, 2, every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(FileNotFoundError, match=r"step=7.*does not exist.*epoch=0-step=2\.ckpt"):
        _fit(tmp_path, 4, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=7.ckpt"), every_n_train_steps=2)


def test_uncommitted_ckpt_path_is_refused_naming_the_alternative(tmp_path):
    _fit(tmp_path, 2, every_n_train_steps=2, save_top_k=-1)
    partial = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    partial.mkdir()
    (partial / "batched").mkdir()
    with pytest.raises(CheckpointError, match=r"without its commit marker.*epoch=0-step=2\.ckpt"):
        _fit(tmp_path, 4, ckpt_path=str(partial), every_n_train_steps=2)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_ft_pwned",))


def test_a_checkpoint_file_holding_a_malicious_pickle_is_refused(tmp_path):
    evil = tmp_path / "evil.ckpt"
    with open(evil, "wb") as f:
        pickle.dump({"state_dict": _Exploit()}, f)
    if os.path.exists("/tmp/lightning_ft_pwned"):
        os.remove("/tmp/lightning_ft_pwned")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        _fit(tmp_path, 2, ckpt_path=str(evil), every_n_train_steps=2)
    assert not os.path.exists("/tmp/lightning_ft_pwned")


def test_tensorboard_keeps_one_version_folder_across_restarts(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    for steps in (2, 4):
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=steps, logger=TensorBoardLogger(tmp_path / "tb"))
        trainer.fit(TinyRegressor())
    versions = [p.name for p in (tmp_path / "tb" / "lightning_logs").iterdir()]
    assert versions == ["version_0"]  # the name Lightning gives it, kept by the later attempt
    assert trainer.logger.version == 0


def test_the_logger_version_is_the_next_free_one_as_under_lightning(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    (tmp_path / "tb" / "lightning_logs" / "version_0").mkdir(parents=True)  # another run's logs
    trainer = make_trainer(tmp_path / "run", max_steps=1, logger=TensorBoardLogger(tmp_path / "tb"))
    trainer.fit(TinyRegressor())
    assert trainer.logger.version == 1
    assert trainer.logger.log_dir == str(tmp_path / "tb" / "lightning_logs" / "version_1")
    assert sorted(p.name for p in (tmp_path / "tb" / "lightning_logs").iterdir()) == ["version_0", "version_1"]


def test_resumed_weights_and_optimizer_state_equal_the_saved_ones(tmp_path):
    trainer, model = _fit(tmp_path, 4, every_n_train_steps=4, save_top_k=-1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = trainer.optimizers[0].state_dict()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer2 = make_trainer(tmp_path, callbacks=[ckpt], max_steps=4)
    model2 = TinyRegressor()
    trainer2.fit(model2)  # resumes at step 4 == max_steps: restores and stops
    for k, v in saved.items():
        assert torch.equal(model2.state_dict()[k], v), k
    restored = trainer2.optimizers[0].state_dict()
    for pid, s in saved_opt["state"].items():
        for name, t in s.items():
            assert torch.equal(restored["state"][pid][name], t), (pid, name)
    assert trainer2.lr_scheduler_configs[0].scheduler.last_epoch == trainer.lr_scheduler_configs[0].scheduler.last_epoch


class _WithValidation(TinyRegressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def val_dataloader(self):
        return self.train_dataloader()


def test_validate_after_fit_in_the_same_process_is_the_same_attempt(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=2, limit_val_batches=2)
    model = _WithValidation()
    trainer.fit(model)
    (metrics,) = trainer.validate(model)
    assert "val_loss" in metrics
    assert [e["attempt"] for e in read_events(tmp_path) if e["event"] == "attempt_start"] == [0]


def test_auto_resume_skips_a_newer_weights_only_checkpoint(tmp_path):
    full = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="full-{step}")
    weights = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, save_weights_only=True, filename="w-{step}"
    )
    _fit(tmp_path, 3, callbacks=[full, weights])
    steps = {p.path.name: p.step for p in list_committed(tmp_path / "ckpt")}
    assert steps == {"full-step=2.ckpt": 2, "w-step=3.ckpt": 3}
    trainer2, _ = _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1, filename="full-{step}")
    assert [e["path"].rsplit("/", 1)[-1] for e in read_events(tmp_path) if e["event"] == "resumed"] == [
        "full-step=2.ckpt"
    ]
    assert trainer2.global_step == 4


def test_a_committed_checkpoint_without_a_step_does_not_break_auto_resume(tmp_path):
    _fit(tmp_path, 2, every_n_train_steps=2, save_top_k=-1)
    writer = AsyncCheckpointer()
    writer.save(tmp_path / "ckpt" / "foreign-tool", {"w": torch.ones(2)}, metadata={})
    writer.close()
    trainer2, _ = _fit(tmp_path, 4, every_n_train_steps=2, save_top_k=-1)
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [2]
