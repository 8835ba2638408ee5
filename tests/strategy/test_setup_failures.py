"""A run that fails anywhere in its set-up shows the user's own error, nothing from teardown, and leaves the strategy
clean: the patch undone, the tracker removed, the checkpoint writer stopped, the Trainer able to fit again."""

from __future__ import annotations

import errno
import logging

import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ft import ElasticFT3D, _compat
from lightning_ft.checkpoint import UncommittedCheckpointError
from lightning_ft.strategy.teardown import TeardownSteps, peer_loss
from lightning_ft.strategy.tracker import TrainingTracker
from tests.strategy.models import TinyRegressor, make_trainer


class Boom(RuntimeError):
    """The user's own error, raised from the hook under test."""


class FailingModule(TinyRegressor):
    """Raises ``Boom`` from the hook named ``fail_in`` (or from nowhere when it is ``None``)."""

    def __init__(self, fail_in: str | None = None) -> None:
        super().__init__()
        self.fail_in = fail_in
        self.raised: Boom | None = None

    def _maybe_fail(self, where: str) -> None:
        if self.fail_in == where:
            self.raised = Boom(f"user error in {where}")
            raise self.raised

    def configure_model(self):
        self._maybe_fail("configure_model")

    def setup(self, stage):
        self._maybe_fail("setup")

    def train_dataloader(self):
        self._maybe_fail("train_dataloader")
        return super().train_dataloader()

    def on_train_start(self):
        self._maybe_fail("on_train_start")

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self._maybe_fail("first training_step")
        return super().training_step(batch, batch_idx)


class FailsAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        raise Boom("user error in a callback's on_train_start")


@pytest.fixture
def teardown_errors(caplog):
    caplog.set_level(logging.ERROR, logger="lightning_ft.strategy.teardown")
    return lambda: [r for r in caplog.records if r.name == "lightning_ft.strategy.teardown"]


def assert_left_clean(trainer):
    strategy = trainer.strategy
    assert "resume_start" not in vars(_compat.checkpoint_connector(trainer)), "the auto-resume patch is still there"
    assert not [cb for cb in trainer.callbacks if isinstance(cb, TrainingTracker)], "the tracker is still attached"
    assert strategy._checkpoints is None or strategy._checkpoints.writer is None, "the checkpoint writer still runs"
    assert strategy._exception is None


@pytest.mark.parametrize(
    "hook", ["configure_model", "setup", "train_dataloader", "on_train_start", "first training_step"]
)
def test_an_error_in_a_module_hook_reaches_the_user_unchanged_and_the_trainer_can_fit_again(
    tmp_path, hook, teardown_errors
):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=2)
    model = FailingModule(fail_in=hook)
    with pytest.raises(Boom) as raised:
        trainer.fit(model)
    assert raised.value is model.raised
    assert raised.value.__context__ is None
    assert teardown_errors() == []
    assert_left_clean(trainer)

    model.fail_in = None
    trainer.fit(model)
    assert trainer.global_step == 2
    assert_left_clean(trainer)


def _launch_failure(tmp_path):
    # Refused by Lightning before it attaches the module to the trainer (as a launcher's refusal is).
    import lightning as L

    trainer = make_trainer(tmp_path, max_steps=1)
    model = TinyRegressor()
    return trainer, lambda: trainer.fit(model, model.train_dataloader(), datamodule=L.LightningDataModule())


def _layout_failure(tmp_path):
    # Refused in setup_distributed, before the event log is opened.
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(tensor_parallel_size=2), max_steps=1)
    return trainer, lambda: trainer.fit(TinyRegressor())


def _writer_failure(tmp_path, monkeypatch):
    # The checkpoint writer's own process group cannot be created: after the event log is open.
    def refuse(*args, **kwargs):
        raise RuntimeError("gloo: connection refused while creating the checkpoint group")

    monkeypatch.setattr(dist, "new_group", refuse)
    trainer = make_trainer(tmp_path, max_steps=1)
    return trainer, lambda: trainer.fit(TinyRegressor())


def _dirpath_failure(tmp_path):
    # Refused in ElasticFT3D.setup, after configure_model: a file stands where a folder of the dirpath must be.
    (tmp_path / "a_file").write_text("")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a_file" / "ckpt", every_n_train_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[ckpt], max_steps=1)
    return trainer, lambda: trainer.fit(TinyRegressor())


def _callback_failure(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[FailsAtTrainStart()], max_steps=1)
    return trainer, lambda: trainer.fit(TinyRegressor())


def _uncommitted_ckpt_path(tmp_path):
    partial = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    (partial / "batched").mkdir(parents=True)
    trainer = make_trainer(tmp_path, max_steps=1)
    return trainer, lambda: trainer.fit(TinyRegressor(), ckpt_path=str(partial))


@pytest.mark.parametrize(
    ("stage", "error", "message"),
    [
        ("launch", MisconfigurationException, "You cannot pass `train_dataloader`"),
        ("layout", ValueError, "tensor_parallel_size=2"),
        ("writer", RuntimeError, "connection refused while creating the checkpoint group"),
        ("dirpath", ValueError, "exists and is not a folder"),
        ("callback", Boom, "user error in a callback's on_train_start"),
        ("ckpt_path", UncommittedCheckpointError, "without its commit marker"),
    ],
)
def test_a_failure_at_each_stage_of_set_up_is_the_error_the_user_gets(
    tmp_path, monkeypatch, teardown_errors, stage, error, message
):
    make = {
        "launch": _launch_failure,
        "layout": _layout_failure,
        "writer": lambda p: _writer_failure(p, monkeypatch),
        "dirpath": _dirpath_failure,
        "callback": _callback_failure,
        "ckpt_path": _uncommitted_ckpt_path,
    }[stage]
    trainer, fit = make(tmp_path)
    with pytest.raises(error, match=message) as raised:
        fit()
    assert type(raised.value) is error  # a teardown error would have replaced it (and named the teardown)
    assert teardown_errors() == []
    assert_left_clean(trainer)


def test_a_failed_background_save_does_not_replace_the_error_that_stopped_the_run(tmp_path, monkeypatch, caplog):
    from lightning_ft.checkpoint.internal import SnapshotStorage

    def disk_full(self, path, entries, *, group):
        raise OSError(errno.ENOSPC, "No space left on device")

    class FailsAfterTheSave(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise Boom("user error right after a save")

    monkeypatch.setattr(SnapshotStorage, "write", disk_full)
    caplog.set_level(logging.ERROR, logger="lightning_ft.strategy.teardown")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    # The save of step 2 fails in the background; the user's error at step 3 comes before any save could report it.
    strategy = ElasticFT3D(checkpoint_format="torchsnapshot")  # the folder's storage is the one made to fail
    trainer = make_trainer(tmp_path, strategy=strategy, callbacks=[ckpt, FailsAfterTheSave()], max_steps=4)
    with pytest.raises(Boom, match="right after a save"):
        trainer.fit(TinyRegressor())
    logged = [r for r in caplog.records if r.name == "lightning_ft.strategy.teardown"]
    assert len(logged) == 1 and "No space left on device" in logged[0].getMessage()
    assert_left_clean(trainer)


def test_teardown_steps_run_all_steps_and_raise_the_first_error_only_when_nothing_else_failed(caplog):
    ran = []

    def fails(name):
        def step():
            ran.append(name)
            raise OSError(f"{name} failed")

        return step

    steps = TeardownSteps(failure=None)
    steps.run(fails("first"), "first")
    steps.run(lambda: ran.append("middle"), "middle")
    steps.run(fails("last"), "last")
    with pytest.raises(OSError, match="first failed"):
        steps.finish()
    assert ran == ["first", "middle", "last"]

    caplog.set_level(logging.ERROR, logger="lightning_ft.strategy.teardown")
    steps = TeardownSteps(failure=Boom("the run's own error"))
    steps.run(fails("close"), "waiting for the checkpoint in flight")
    steps.finish()  # nothing raised: the run's own error propagates
    assert "waiting for the checkpoint in flight" in caplog.records[-1].getMessage()


GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    " [127.0.0.1]:9358. This is typically caused by a remote worker crashing."
)
GLOO_RESET = "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:49057: Connection reset by peer. GLHF!"


def test_peer_loss_recognises_a_peer_that_went_away_and_nothing_else():
    assert peer_loss(RuntimeError(GLOO_CLOSED), rank=0, world_size=2) == "connection closed by rank 1 at 127.0.0.1:9358"
    assert peer_loss(RuntimeError(GLOO_CLOSED), rank=1, world_size=4) == "connection closed by a peer at 127.0.0.1:9358"
    assert peer_loss(RuntimeError(GLOO_RESET), rank=1, world_size=2) == "connection reset by rank 0"
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error")
    assert peer_loss(nccl, rank=0, world_size=8).startswith("the process group failed: NCCL error in")
    wrapped = RuntimeError("checkpoint save failed")
    wrapped.__cause__ = RuntimeError(GLOO_CLOSED)
    assert peer_loss(wrapped, rank=0, world_size=2) == "connection closed by rank 1 at 127.0.0.1:9358"
    # A teardown error raised while the run's own (peer) error is handled is not a peer loss because of that context.
    own = OSError("No space left on device")
    own.__context__ = RuntimeError(GLOO_CLOSED)
    assert peer_loss(own, rank=0, world_size=2) is None
    assert peer_loss(Boom("the user's error"), rank=0, world_size=2) is None


def test_a_teardown_step_failed_by_a_lost_peer_is_one_warning_line_that_blames_the_peer(caplog):
    caplog.set_level(logging.WARNING, logger="lightning_ft.strategy.teardown")

    def close():
        raise RuntimeError(GLOO_CLOSED)

    steps = TeardownSteps(failure=RuntimeError(GLOO_CLOSED), rank=0, world_size=2)
    steps.run(close, "waiting for the checkpoint in flight", after_peer_loss=lambda: "the save of step 4 is lost")
    steps.run(fails_with_oserror, "undoing the auto-resume patch")
    steps.finish()  # nothing raised: the run's own error propagates
    (peer, other) = caplog.records
    assert peer.levelno == logging.WARNING and peer.exc_info is None  # no traceback: nothing of ours failed
    assert peer.getMessage() == (
        "lightning-ft: rank 0 lost a peer (connection closed by rank 1 at 127.0.0.1:9358) while waiting for the"
        " checkpoint in flight; the save of step 4 is lost. Expected when another process of the run dies: the"
        " failure is that process's (its own output says why), not this one's"
    )
    assert "\n" not in peer.getMessage()
    # Any other teardown error is still reported as one, with its traceback.
    assert other.levelno == logging.ERROR and other.exc_info is not None
    assert other.getMessage().startswith("lightning-ft: teardown failed while undoing the auto-resume patch")


def test_a_lost_peer_in_a_run_that_otherwise_succeeded_still_raises():
    def close():
        raise RuntimeError(GLOO_CLOSED)

    steps = TeardownSteps(failure=None, rank=0, world_size=2)
    steps.run(close, "waiting for the checkpoint in flight", after_peer_loss=lambda: "lost")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        steps.finish()


def fails_with_oserror():
    raise OSError("patch already undone")
