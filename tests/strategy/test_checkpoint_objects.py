"""Objects a LightningModule puts into the checkpoint come back as themselves: a custom object stored in
``on_save_checkpoint`` and an ``nn.Module`` in the hyperparameters (as pytorch-forecasting does). Without the class
allowed through ``torch.serialization.safe_globals`` every save still commits (as under ``DDPStrategy``) with a warning
naming the key and the fix, and the resume is refused until it is allowed; allowed, they come back equal."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import UnsafeCheckpointError, discovery
from tests.strategy.models import RandomVectors, TinyRegressor


class Vocabulary:
    """A user's own class, with no plain encoding."""

    def __init__(self, words: list[str]) -> None:
        self.words = list(words)

    def __eq__(self, other: object) -> bool:
        return type(other) is Vocabulary and other.words == self.words


class WithVocabulary(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.vocabulary = Vocabulary(["a", "b"])
        self.restored: Any = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["vocabulary"] = self.vocabulary

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restored = checkpoint["vocabulary"]


class WithLossModule(L.LightningModule):
    """pytorch-forecasting's pattern: the loss module is a hyperparameter, set back as an attribute on load."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loss = loss
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomVectors(), batch_size=4)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loss = checkpoint["hyper_parameters"]["loss"]  # a str here fails: "cannot assign 'str' as child module"


def _fit(
    model: L.LightningModule, root, *, max_steps: int, ckpt_path: str | None = None, checkpoint_format: str = "auto"
) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticFT3D(checkpoint_format=checkpoint_format),
        default_root_dir=root,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_last=True)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_a_custom_object_not_allowed_is_saved_with_a_warning_and_its_resume_names_the_fix(tmp_path):
    with pytest.warns(
        UserWarning, match=r"vocabulary is a tests\.strategy\.test_checkpoint_objects\.Vocabulary.*add_safe_globals"
    ):
        _fit(WithVocabulary(), tmp_path, max_steps=2, checkpoint_format="torchsnapshot")
    listed = [c.path.name for c in discovery.list_committed(tmp_path / "checkpoints")]
    assert sorted(listed) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # `last`: a checkpoint of its own, as Lightning's
    with pytest.raises(UnsafeCheckpointError, match=r"vocabulary: .*Vocabulary.*add_safe_globals"):
        _fit(WithVocabulary(), tmp_path, max_steps=4, ckpt_path="last")
    with torch.serialization.safe_globals([Vocabulary]):
        resumed = WithVocabulary()
        _fit(resumed, tmp_path, max_steps=4, ckpt_path="last")
    assert resumed.restored == Vocabulary(["a", "b"])


def test_an_allowed_custom_object_comes_back_equal_and_of_its_class(tmp_path):
    with torch.serialization.safe_globals([Vocabulary]):
        _fit(WithVocabulary(), tmp_path, max_steps=2)
        resumed = WithVocabulary()
        _fit(resumed, tmp_path, max_steps=4, ckpt_path="last")
    assert type(resumed.restored) is Vocabulary and resumed.restored == Vocabulary(["a", "b"])


def test_an_nn_module_in_the_hyperparameters_comes_back_as_that_module(tmp_path):
    with pytest.warns(UserWarning, match=r"hyper_parameters/loss is a torch\.nn\.modules\.loss\.SmoothL1Loss"):
        _fit(WithLossModule(nn.SmoothL1Loss(beta=0.5)), tmp_path / "not-allowed", max_steps=2)
    with torch.serialization.safe_globals([nn.SmoothL1Loss]):
        _fit(WithLossModule(nn.SmoothL1Loss(beta=0.5)), tmp_path, max_steps=2)
        resumed = WithLossModule(nn.SmoothL1Loss(beta=2.0))
        _fit(resumed, tmp_path, max_steps=4, ckpt_path="last")
    assert type(resumed.loss) is nn.SmoothL1Loss and resumed.loss.beta == 0.5
