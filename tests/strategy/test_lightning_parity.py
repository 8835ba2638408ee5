"""What Lightning's own test suite checks of a strategy, held here with ``DDPStrategy`` as the oracle: the same
script under both, the same outcome (docs/lightning-compatibility.md lists what differs by design)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D
from tests.strategy.models import TinyRegressor, make_trainer

STRATEGIES = {"ddp": DDPStrategy, "elastic_ft3d": ElasticFT3D}


class _RecordingIO(TorchCheckpointIO):
    """A user's ``CheckpointIO`` that takes ``storage_options`` (an object store's metadata, say): it records them and
    writes the checkpoint as Lightning's own plugin does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append((str(path), storage_options))
        super().save_checkpoint(checkpoint, path)


def _fitted(tmp_path, strategy, **kwargs):
    trainer = make_trainer(tmp_path, strategy=STRATEGIES[strategy](), max_steps=2, enable_checkpointing=False, **kwargs)
    trainer.fit(TinyRegressor())
    return trainer


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_storage_options_of_a_save_reach_the_users_checkpoint_io(tmp_path, strategy):
    io = _RecordingIO()
    trainer = _fitted(tmp_path, strategy, plugins=[io])
    path = tmp_path / "tagged.ckpt"
    trainer.save_checkpoint(path, storage_options={"tags": {"stage": "after-fit"}})
    assert io.calls == [(str(path), {"tags": {"stage": "after-fit"}})]
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 2
    weights = trainer.lightning_module.state_dict()
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items())


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_storage_options_with_lightnings_default_checkpoint_io_are_refused_as_lightning_refuses_them(
    tmp_path, strategy
):
    trainer = _fitted(tmp_path, strategy)
    with pytest.raises(TypeError, match=r"storage_options.*not supported for `TorchCheckpointIO`"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"tags": {}})
    assert not (tmp_path / "x.ckpt").exists()


class _Fails(Exception):
    pass


class _FailsMidEpoch(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.current_epoch == 1 and batch_idx == 2:
            raise _Fails
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("ends", ["normally", "raising"])
def test_the_fit_loop_state_after_fit_holds_no_loader_state_as_under_ddp_strategy(tmp_path, strategy, ends):
    """Lightning's fit loop keeps its training loaders after ``fit``: what its ``state_dict()`` lists then, and what
    a loop state loaded into it gives back, is what it is under ``DDPStrategy``."""
    trainer = make_trainer(tmp_path, strategy=STRATEGIES[strategy](), max_epochs=2, enable_checkpointing=False)
    if ends == "raising":
        with pytest.raises(_Fails):
            trainer.fit(_FailsMidEpoch())
    else:
        trainer.fit(TinyRegressor())
    state = trainer.fit_loop.state_dict()
    assert state["state_dict"] == {}
    trainer.fit_loop.load_state_dict(state)
    assert trainer.fit_loop.state_dict() == state


class _FailsAtStep(TinyRegressor):
    def __init__(self, step=None):
        super().__init__()
        self.fail_at = step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise _Fails
        return super().training_step(batch, batch_idx)


def _fit(root, *, max_steps, fail_at=None, ckpt_path=None):
    from lightning.pytorch import seed_everything

    seed_everything(7)
    model = _FailsAtStep(fail_at)
    trainer = make_trainer(root, max_steps=max_steps, enable_checkpointing=False)
    if fail_at is None:
        trainer.fit(model, ckpt_path=ckpt_path)
    else:
        with pytest.raises(_Fails):
            trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_save_after_a_fit_that_raised_in_the_middle_of_an_epoch_resumes_exactly(tmp_path):
    """Between stages the training loaders are not stateful (as under ``DDPStrategy``), yet a
    ``trainer.save_checkpoint`` after a ``fit`` that raised in the middle of an epoch (the user's ``except`` block)
    keeps their positions: the run resumed from it ends with the weights of the uninterrupted one."""
    _, uninterrupted = _fit(tmp_path / "whole", max_steps=10)
    failed, _ = _fit(tmp_path / "first", max_steps=10, fail_at=5)  # 16 batches an epoch: in the middle
    saved = tmp_path / "saved-after-the-error.ckpt"
    failed.save_checkpoint(saved)
    resumed, weights = _fit(tmp_path / "second", max_steps=10, ckpt_path=str(saved))
    assert resumed.global_step == 10
    assert all(torch.equal(weights[k], v) for k, v in uninterrupted.items())


@pytest.mark.parametrize("strategy", ["auto", "elastic_ft3d"])
@pytest.mark.parametrize("exception_type", [KeyboardInterrupt, RuntimeError])
def test_a_failure_reaches_the_base_strategy_hook_as_with_the_default_strategy(
    tmp_path, monkeypatch, strategy, exception_type
):
    """``Strategy.on_exception`` (patched, or the hook a subclass of the default strategy overrides) sees the error
    of a failed ``fit`` once, as with the default strategy of one device (``DDPStrategy``'s own hook never calls it)."""
    from contextlib import suppress
    from unittest import mock

    from lightning.pytorch.strategies import Strategy

    hook = mock.Mock()
    monkeypatch.setattr(Strategy, "on_exception", hook)
    exception = exception_type("raised in on_fit_start")

    class RaisesAtFitStart(TinyRegressor):
        def on_fit_start(self):
            raise exception

    trainer = make_trainer(tmp_path, strategy="auto" if strategy == "auto" else ElasticFT3D(), max_steps=2)
    with suppress(Exception, SystemExit):
        trainer.fit(RaisesAtFitStart())
    hook.assert_called_once_with(exception)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("limit_train_batches", [1.0, 4])
def test_a_resume_from_the_end_of_an_epoch_counts_the_batches_before_it_as_ddp_strategy_does(
    tmp_path, strategy, limit_train_batches
):
    """Lightning's count of training batches over all epochs (what ``val_check_interval`` counts with
    ``check_val_every_n_epoch=None``, and what the next checkpoint's loop state holds) goes on from the checkpoint of
    an epoch's end: 16 batches an epoch (or 4 with ``limit_train_batches=4``), two epochs."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_epochs, ckpt_path=None):
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
        trainer = make_trainer(
            tmp_path,
            strategy=STRATEGIES[strategy](),
            callbacks=[ckpt],
            max_epochs=max_epochs,
            limit_train_batches=limit_train_batches,
        )
        trainer.fit(TinyRegressor(), ckpt_path=ckpt_path)
        return trainer

    fit(1)
    resumed = fit(2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    per_epoch = 16 if limit_train_batches == 1.0 else 4
    assert resumed.global_step == 2 * per_epoch
    assert resumed.fit_loop.epoch_loop.batch_progress.total.completed == 2 * per_epoch
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["loops"]["fit_loop"]
    assert saved["epoch_loop.batch_progress"]["total"]["completed"] == 2 * per_epoch
