"""Auto-resume resumes this run and nothing else, in one process (issue 30): the same script under ``DDPStrategy`` is
the oracle.

(A) a second ``fit`` of the same Trainer continues from the live step; (B) a new Trainer on a trained model trains
from the live weights; (C) another experiment from the same working folder with a new checkpoint folder never restores
the first one's memory copy; (D) a checkpoint of another model in the same folder is named once, left alone, and the
run trains from scratch. The 2-process cases under torchrun are in tests/e2e/test_resume_identity.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_ft import ElasticFT3D, MemoryTier
from lightning_ft.checkpoint import discovery
from lightning_ft.events import read_events
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer


@pytest.fixture(autouse=True)
def _event_log_on_disk(monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_EVENT_LOG", "always")  # the tests read the resumed/rejected events


def _release_process_group() -> None:
    # DDPStrategy leaves its group of one process up: the next Trainer in this process must make its own.
    if dist.is_initialized():
        dist.destroy_process_group()


def _strategy(kind: str, **kwargs: Any) -> Any:
    return DDPStrategy() if kind == "ddp" else ElasticFT3D(**kwargs)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _checkpoint(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1)


def _second_fit_same_trainer(root: Path, kind: str) -> tuple[int, dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model = TinyRegressor()
    trainer = make_trainer(root, strategy=_strategy(kind), callbacks=[_checkpoint(root)], max_steps=10)
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 14
    trainer.fit(model)
    _release_process_group()
    return trainer.global_step, _weights(model)


def test_a_second_fit_of_the_same_trainer_continues_from_the_live_step_as_under_ddp(tmp_path):
    """(A) The newest checkpoint on disk is step 8, the live model is at step 10: the second fit trains steps 11-14
    from the live state, as Lightning does, and never rewinds to step 8."""
    step, weights = _second_fit_same_trainer(tmp_path / "ft", "ft")
    oracle_step, oracle = _second_fit_same_trainer(tmp_path / "ddp", "ddp")
    assert step == oracle_step == 14
    assert_same(weights, oracle)
    assert not [e for e in read_events(tmp_path / "ft") if e["event"] == "resumed"]


def _new_trainer_on_trained_model(root: Path, kind: str) -> tuple[int, dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model = TinyRegressor()
    make_trainer(root, strategy=_strategy(kind), callbacks=[_checkpoint(root)], max_steps=12).fit(model)
    stage_two = make_trainer(root, strategy=_strategy(kind), callbacks=[_checkpoint(root)], max_steps=6)
    stage_two.fit(model)
    _release_process_group()
    return stage_two.global_step, _weights(model)


def test_a_new_trainer_on_a_trained_model_trains_from_the_live_weights_as_under_ddp(tmp_path):
    """(B) Stage 2 (a new Trainer, ``max_steps=6``, the same checkpoint folder) trains 6 steps from the stage-1
    weights: it neither resumes stage 1's step-12 checkpoint (zero steps) nor rewinds the model to it."""
    step, weights = _new_trainer_on_trained_model(tmp_path / "ft", "ft")
    oracle_step, oracle = _new_trainer_on_trained_model(tmp_path / "ddp", "ddp")
    assert step == oracle_step == 6
    assert_same(weights, oracle)


class WideRegressor(L.LightningModule):
    """TinyRegressor with the hidden width as a hyperparameter: a "second experiment" with a wider layer."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    training_step = TinyRegressor.training_step
    train_dataloader = TinyRegressor.train_dataloader

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _wide_run(root: Path, kind: str, hidden: int) -> tuple[int, dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model = WideRegressor(hidden)
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    trainer = make_trainer(root, strategy=_strategy(kind), callbacks=callbacks, max_steps=4)
    trainer.fit(model)
    _release_process_group()
    return trainer.global_step, _weights(model)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_of_another_model_in_the_folder_is_named_once_left_alone_and_training_starts_from_scratch(
    tmp_path,
):
    """(D) Experiment 2 has a wider layer and the same checkpoint folder: under DDPStrategy it trains from scratch;
    under ElasticFT3D it does too, after one message naming experiment 1's newest checkpoint, why it is not this
    run's and the ways out; experiment 1's files stay as they were."""
    _wide_run(tmp_path / "ft", "ft", hidden=16)
    before = _files(tmp_path / "ft" / "ckpt")
    newest = discovery.latest_committed(tmp_path / "ft" / "ckpt")
    assert newest is not None and newest.step == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, weights = _wide_run(tmp_path / "ft", "ft", hidden=32)
    said = [str(w.message) for w in caught if "not this run's" in str(w.message)]
    assert len(said) == 1, said
    (message,) = said
    assert str(newest.path) in message and "parameters differ" in message
    for way_out in ("auto_resume=False", "dirpath", "ckpt_path="):
        assert way_out in message
    after = _files(tmp_path / "ft" / "ckpt")
    assert all(after.get(name) == data for name, data in before.items())  # nothing of experiment 1 changed
    _wide_run(tmp_path / "ddp", "ddp", hidden=16)
    oracle_step, oracle = _wide_run(tmp_path / "ddp", "ddp", hidden=32)
    assert step == oracle_step == 4
    assert_same(weights, oracle)
    (rejected,) = [e for e in read_events(tmp_path / "ft") if e["event"] == "checkpoint_rejected"]
    assert rejected["path"] == str(newest.path) and rejected["step"] == 4


def test_a_restart_of_the_second_experiment_resumes_its_own_checkpoint_not_the_other_one(tmp_path):
    """After D, the folder holds both experiments' checkpoints: a restart of experiment 2 resumes its own newest, and
    one of the other model is still never a candidate."""
    _wide_run(tmp_path, "ft", hidden=16)
    _wide_run(tmp_path, "ft", hidden=32)
    as_a_new_process()
    L.seed_everything(0)
    model = WideRegressor(32)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=6)
    trainer.fit(model)
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [4]
    assert "-v1" in resumed[0]["path"]  # experiment 2's own step-4 file (Lightning's version suffix beside exp. 1's)


def test_a_checkpoint_without_an_identity_still_resumes(tmp_path, monkeypatch):
    """A checkpoint of an older release records no identity: it stays a candidate (format compatibility)."""
    from lightning_ft.strategy import elastic_ft3d

    monkeypatch.setattr(elastic_ft3d.ElasticFT3D, "run_identity", lambda self: None)
    _wide_run(tmp_path, "ft", hidden=16)
    monkeypatch.undo()
    assert discovery.read_metadata(discovery.latest_committed(tmp_path / "ckpt").path)["run_identity"] is None
    as_a_new_process()
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=6).fit(WideRegressor(16))
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]


class RenamedRegressor(WideRegressor):
    """The same parameters under another class name (a class the user renamed between launches)."""


@pytest.mark.parametrize("run_id", [None, "my-run"])
def test_lightning_ft_run_id_naming_the_checkpoints_run_makes_a_checkpoint_of_another_class_this_runs(
    tmp_path, monkeypatch, run_id
):
    """Without ``LIGHTNING_FT_RUN_ID`` a checkpoint of another class is skipped; with it set to the run id the
    checkpoint recorded, the user says it is this run: it is resumed."""
    if run_id is not None:
        monkeypatch.setenv("LIGHTNING_FT_RUN_ID", run_id)
    _wide_run(tmp_path, "ft", hidden=16)
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=6).fit(RenamedRegressor(16))
    events = read_events(tmp_path)
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    rejected = [e["reason"] for e in events if e["event"] == "checkpoint_rejected"]
    if run_id is None:
        assert resumed == [] and len(rejected) == 1 and "written by a WideRegressor" in rejected[0]
    else:
        assert resumed == [4] and rejected == []


def test_a_relaunch_with_other_hyperparameters_is_the_same_run(tmp_path):
    """Hyperparameters are recorded, not compared: a relaunch with another learning rate resumes (as a relaunch with
    another per-device batch does, tests/strategy/test_elastic_resume.py)."""
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=4).fit(TinyRegressor(lr=0.1))
    as_a_new_process()
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=6).fit(TinyRegressor(lr=0.05))
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def _experiment(root: Path, ckpt: str, kind: str, *, lr: float, crash: int | None = None) -> dict[str, torch.Tensor]:
    L.seed_everything(0)
    model = TinyRegressor(lr=lr)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=root / ckpt, every_n_train_steps=100)]  # memory only
    if crash is not None:
        callbacks.append(CrashAt(crash))
    strategy = _strategy(kind, memory_tier=MemoryTier(every_n_train_steps=2))
    trainer = make_trainer(root, strategy=strategy, callbacks=callbacks, max_steps=6)
    if crash is None:
        trainer.fit(model)
    else:
        with pytest.raises(RuntimeError, match="crash at step"):
            trainer.fit(model)
    _release_process_group()
    return _weights(model)


def test_another_experiment_with_a_new_checkpoint_folder_never_restores_the_first_ones_memory_copy(
    tmp_path, monkeypatch
):
    """(C) Experiment A (memory tier every 2 steps) crashes at step 5 with a memory copy of step 4; experiment B starts
    from the same working folder with a new, empty checkpoint folder and another learning rate: it trains from scratch,
    as under DDPStrategy, and A's copy is still there for A's restart."""
    shm = tmp_path / "shm"
    monkeypatch.setenv("LIGHTNING_FT_MEMORY_DIR", str(shm))
    _experiment(tmp_path / "ft", "ckpt-a", "ft", lr=0.1, crash=5)
    a_copies = sorted(p.relative_to(shm) for p in shm.glob("lightning-ft/*/rank0/step=*"))
    assert [p.name for p in a_copies] == ["step=4"]
    b = _experiment(tmp_path / "ft", "ckpt-b", "ft", lr=0.05)
    oracle = _experiment(tmp_path / "ddp", "ckpt-b", "ddp", lr=0.05)
    assert_same(b, oracle)
    assert not [e for e in read_events(tmp_path / "ft") if e["event"] == "resumed"]
    assert sorted(p.relative_to(shm) for p in shm.glob("lightning-ft/*/rank0/step=*")) == a_copies
    # A's restart still finds it.
    as_a_new_process()
    _experiment(tmp_path / "ft", "ckpt-a", "ft", lr=0.1)
    resumed = [e for e in read_events(tmp_path / "ft") if e["event"] == "resumed"]
    assert [(e["step"], e.get("tier")) for e in resumed] == [(4, "local")]


def test_the_identity_of_a_lazy_module_leaves_out_the_parameters_until_they_exist():
    """A LazyLinear has no shape before its first forward: auto-resume must not fail on it, and compares the class."""
    from lightning_ft.strategy.run_identity import identity_mismatch, module_identity

    class Lazy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.LazyLinear(3)

    model = Lazy()
    before = module_identity(model)
    assert before is not None and before["parameters"] is None
    model.layer(torch.zeros(2, 4))
    after = module_identity(model)
    assert after is not None and after["parameters"] is not None
    assert identity_mismatch({"run_identity": after}, before) is None
    assert "written by a Other" in identity_mismatch({"run_identity": {**after, "module": "Other"}}, before)


class FailsSetUpOnce(WideRegressor):
    failed = False

    def setup(self, stage: str) -> None:
        if not FailsSetUpOnce.failed:
            FailsSetUpOnce.failed = True
            raise RuntimeError("set-up failed once")


def test_a_fit_that_failed_before_its_first_step_leaves_auto_resume_on_for_the_retry(tmp_path):
    """Only a fit that ended at a step above 0 makes the model live: in a relaunch, a retry after a failed set-up
    (nothing trained, nothing restored) resumes the run's checkpoint."""
    FailsSetUpOnce.failed = True
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=4).fit(FailsSetUpOnce(16))
    as_a_new_process()
    FailsSetUpOnce.failed = False
    L.seed_everything(0)
    model = FailsSetUpOnce(16)
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(), callbacks=callbacks, max_steps=6)
    with pytest.raises(RuntimeError, match="set-up failed once"):
        trainer.fit(model)
    trainer.fit(model)
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]
    assert trainer.global_step == 6
