"""A run whose LightningModule fails in ``configure_model``, launched under real torchrun by the tests.

The Trainer is written as in the README (no ``accelerator``, ``devices`` or ``num_nodes``), so the launch itself
must succeed and the user's own error must be the one every rank reports, attempt after attempt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D  # noqa: E402
from tests.strategy.models import TinyRegressor  # noqa: E402


class UserConfigError(RuntimeError):
    pass


class FailsInConfigureModel(TinyRegressor):
    def configure_model(self) -> None:
        raise UserConfigError("the user's own error in configure_model")


if __name__ == "__main__":
    torch.set_num_threads(1)
    root = Path(sys.argv[1])
    trainer = L.Trainer(
        strategy=ElasticFT3D(),
        max_steps=2,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=1)],
    )
    trainer.fit(FailsInConfigureModel())
