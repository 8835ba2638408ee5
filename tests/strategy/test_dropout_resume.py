"""A run resumed from a mid-run checkpoint draws the same dropout masks as the run that saved it: every RNG state the
model draws from (the CPU generator, and on CUDA the CUDA generators) is saved per rank and put back at the first batch.
The CUDA case needs a GPU (tests/conftest.py skips it without one; scripts/gpu_check.sh runs it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from tests.strategy.models import TinyRegressor, make_trainer


class _DropoutRegressor(TinyRegressor):
    """The tiny regressor with dropout between its layers; records each step's loss by global step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Tanh(), nn.Linear(64, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses[self.global_step] = loss.item()
        return loss


def _fit(tmp_path, accelerator: str, *, ckpt_path: str | None = None) -> _DropoutRegressor:
    model = _DropoutRegressor()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(tmp_path, accelerator=accelerator, callbacks=[ckpt], max_steps=8)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_run_resumed_mid_epoch_draws_the_dropout_masks_of_the_run_that_saved(tmp_path, accelerator):
    saved_by = _fit(tmp_path, accelerator)
    torch.manual_seed(1234)  # the resuming process's generators (CUDA's included) are somewhere else
    resumed = _fit(tmp_path, accelerator, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    assert sorted(resumed.losses) == list(range(3, 8))
    assert resumed.losses == {step: saved_by.losses[step] for step in range(3, 8)}
