"""The ordinary Lightning code that broke the deferred capture of 0.2.0, each as a user writes it: every checkpoint
Lightning would commit is committed, and each holds, bitwise, the state at its save call.

Each test records the dict handed to every save call (tests/strategy/consistency.py) and compares every committed
checkpoint with it after ``fit``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor
from lightning_ft.checkpoint import discovery
from tests.strategy.consistency import SaveCallRecorder, check_committed, trainer_for


def _data(n: int = 16, batch_size: int = 4) -> DataLoader:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size, shuffle=True)


class Net(L.LightningModule):
    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, history_size=4)
        if self.optimizer_name == "duck":
            return DuckTypedSGD(self.parameters(), lr=0.05)
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return _data()

    def val_dataloader(self) -> DataLoader:
        return _data(n=4)


class DuckTypedSGD:
    """Satisfies Lightning's ``Optimizable`` protocol without subclassing ``torch.optim.Optimizer``."""

    def __init__(self, params: Any, lr: float) -> None:
        self._inner = torch.optim.SGD(params, lr=lr, momentum=0.9)
        self.defaults = self._inner.defaults

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @property
    def state(self) -> Any:
        return self._inner.state

    def step(self, closure: Any = None) -> Any:
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)


def _fit(tmp_path: Path, module: L.LightningModule, callbacks: list[Callback], **kwargs: Any) -> SaveCallRecorder:
    strategy = ElasticFT3D(
        checkpoint_format=kwargs.pop("checkpoint_format", "torchsnapshot"),
        find_unused_parameters=kwargs.pop("find_unused_parameters", False),
    )
    recorder = SaveCallRecorder(strategy)
    trainer = trainer_for(tmp_path, strategy, callbacks, **kwargs)
    trainer.fit(module)
    return recorder


def _assert_every_save_committed_as_called(recorder: SaveCallRecorder, at_least: int) -> None:
    compared, problems = check_committed(recorder)
    assert compared >= at_least, f"only {compared} saves"
    assert not problems, "; ".join(problems[:10])


def _every_step(tmp_path: Path, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=-1, **kwargs)


class ClipsWeights(Net):
    """WGAN's critic: weights clamped in place under no_grad right after every batch (after ModelCheckpoint's save)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.01, 0.01)


class WritesThroughData(Net):
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for p in self.parameters():
            p.data.mul_(0.5)


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "dcp", "file"])
@pytest.mark.parametrize("module_class", [ClipsWeights, WritesThroughData], ids=["clamp under no_grad", ".data"])
def test_a_module_that_writes_its_weights_after_every_batch_commits_every_checkpoint_as_saved(
    tmp_path, module_class, checkpoint_format
):
    recorder = _fit(
        tmp_path,
        module_class(),
        [_every_step(tmp_path)],
        max_epochs=2,
        limit_val_batches=0,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=8)


class SwapsInAverage(Callback):
    """The common EMA callback: keeps an average, swaps it in for validation through ``.data``, swaps back after."""

    def __init__(self) -> None:
        self.average: list[torch.Tensor] | None = None
        self.backup: list[torch.Tensor] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        params = list(pl_module.parameters())
        if self.average is None:
            self.average = [p.detach().clone() for p in params]
        for avg, p in zip(self.average, params, strict=True):
            avg.mul_(0.9).add_(p.detach(), alpha=0.1)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.average is None:
            return
        params = list(pl_module.parameters())
        self.backup = [p.detach().clone() for p in params]
        for avg, p in zip(self.average, params, strict=True):
            p.data.copy_(avg)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.backup is not None:
            for saved, p in zip(self.backup, pl_module.parameters(), strict=True):
                p.data.copy_(saved)
            self.backup = None

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.average = state_dict["average"]


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_an_ema_callback_swapping_weights_at_validation_start_never_leaks_into_the_checkpoint_before_it(
    tmp_path, checkpoint_format
):
    recorder = _fit(
        tmp_path,
        Net(),
        [SwapsInAverage(), _every_step(tmp_path)],
        max_epochs=3,
        limit_val_batches=1,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=12)


@pytest.mark.skipif(not hasattr(lightning_callbacks, "EMAWeightAveraging"), reason="Lightning 2.6 added it")
def test_lightnings_ema_weight_averaging_commits_every_checkpoint_as_saved(tmp_path):
    ema = lightning_callbacks.EMAWeightAveraging(decay=0.9)
    recorder = _fit(tmp_path, Net(), [ema, _every_step(tmp_path)], max_epochs=3, limit_val_batches=1)
    _assert_every_save_committed_as_called(recorder, at_least=12)


def test_lightnings_swa_with_batchnorm_and_no_validation_commits_every_checkpoint_as_saved(tmp_path):
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_epochs=1, save_top_k=-1)
    recorder = _fit(
        tmp_path,
        Net(),
        [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2), every_epoch],
        max_epochs=4,
        limit_val_batches=0,
    )
    _assert_every_save_committed_as_called(recorder, at_least=4)
    # SWA adds one epoch that recomputes BatchNorm statistics with the averaged weights: Lightning saves after it too.
    saved = {Path(p).name for p, _ in recorder.saves}
    assert {info.path.name for info in discovery.list_committed(tmp_path / "checkpoints")} == saved
    assert len(saved) == 5


def test_a_duck_typed_optimizer_saves_and_commits(tmp_path):
    recorder = _fit(tmp_path, WritesThroughData("duck"), [_every_step(tmp_path)], max_epochs=2, limit_val_batches=0)
    _assert_every_save_committed_as_called(recorder, at_least=8)


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_lbfgs_with_a_closure_commits_every_checkpoint_as_saved(tmp_path, checkpoint_format):
    recorder = _fit(
        tmp_path,
        ClipsWeights("lbfgs"),
        [_every_step(tmp_path)],
        max_epochs=2,
        limit_val_batches=0,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=8)


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_gradient_accumulation_commits_every_checkpoint_as_saved(tmp_path, checkpoint_format):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=-1)
    recorder = _fit(
        tmp_path,
        WritesThroughData(),
        [checkpoints],
        max_epochs=4,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=8)


class TwoOptimizers(L.LightningModule):
    """Manual optimization with a generator and a critic, the critic clipped after its step, as WGAN does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(8, 8)
        self.critic = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_c = self.optimizers()
        x, _ = batch
        critic_loss = self.critic(self.generator(x).detach()).mean() - self.critic(x).mean()
        opt_c.zero_grad()
        self.manual_backward(critic_loss)
        opt_c.step()
        gen_loss = -self.critic(self.generator(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(gen_loss)
        opt_g.step()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for p in self.critic.parameters():
                p.clamp_(-0.05, 0.05)

    def configure_optimizers(self) -> Any:
        return [torch.optim.RMSprop(self.generator.parameters(), lr=1e-3), torch.optim.Adam(self.critic.parameters())]

    def train_dataloader(self) -> DataLoader:
        return _data()


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_manual_optimization_with_two_optimizers_commits_every_checkpoint_as_saved(tmp_path, checkpoint_format):
    recorder = _fit(
        tmp_path,
        TwoOptimizers(),
        [_every_step(tmp_path)],
        max_epochs=2,
        limit_val_batches=0,
        find_unused_parameters=True,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=8)


class WritesThenSavesLast(ModelCheckpoint):
    """A second ModelCheckpoint saving ``last`` at the same step, after user code wrote the weights (here: its own
    hook, before it saves)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for p in pl_module.parameters():
            p.data.add_(1.0)
        super().on_train_batch_end(trainer, pl_module, *args)


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_last_saved_after_a_write_at_the_same_step_holds_its_own_state_not_a_link_to_the_earlier_save(
    tmp_path, checkpoint_format
):
    dirpath = tmp_path / "checkpoints"
    every_step = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    last = WritesThenSavesLast(dirpath=dirpath, every_n_train_steps=1, save_top_k=0, save_last=True)
    recorder = _fit(
        tmp_path, Net(), [every_step, last], max_epochs=2, limit_val_batches=0, checkpoint_format=checkpoint_format
    )
    _assert_every_save_committed_as_called(recorder, at_least=9)
    # A checkpoint of its own (its content is checked against its own save call above), never a link to the earlier save.
    assert not (dirpath / "last.ckpt").is_symlink()
    assert not os.path.samefile(dirpath / "last.ckpt", dirpath / "step=8.ckpt"), "last is a state it does not hold"


@pytest.mark.parametrize("checkpoint_format", ["torchsnapshot", "file"])  # a folder, and one file (one process)
def test_two_checkpoint_callbacks_saving_the_same_state_at_one_step_write_two_checkpoints_of_their_own(
    tmp_path, checkpoint_format
):
    # The monitors keep state in the checkpoint too: it must not change between two saves of one step.
    dirpath = tmp_path / "checkpoints"
    every_step = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    last = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=0, save_last=True, mode="max")
    monitors = [StragglerMonitor(), ThermalMonitor(), GoodputMonitor()]
    recorder = _fit(
        tmp_path,
        Net(),
        [*monitors, every_step, last],
        max_epochs=2,
        limit_val_batches=0,
        checkpoint_format=checkpoint_format,
    )
    _assert_every_save_committed_as_called(recorder, at_least=9)
    # As Lightning writes them: two checkpoints (each checked against its own save call above), no link between them,
    # so an edit of one never reaches the other; `last` was written from the capture of the save before it.
    assert not (dirpath / "last.ckpt").is_symlink()
    assert not os.path.samefile(dirpath / "last.ckpt", dirpath / "step=8.ckpt")
