"""What ``ElasticFT3D`` attaches to the Trainer for one run: its callbacks, one logger folder across restarts, and the
warnings about settings that would defeat auto-resume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["attach_to_trainer"]


def attach_to_trainer(trainer: pl.Trainer, *, callbacks: list[Any], run_id: str) -> None:
    """Put ``callbacks`` first in ``trainer.callbacks`` (in this order; those already there stay where they are),
    keep every logger's version at ``run_<run_id>``, and warn about a ``ModelCheckpoint`` without a ``dirpath``."""
    for position, callback in enumerate(callbacks):
        if callback not in trainer.callbacks:
            trainer.callbacks.insert(position, callback)
    for logger in trainer.loggers:
        # TensorBoard's default version counts up at every launch; one run must keep one folder across restarts.
        _compat.set_logger_version(logger, f"run_{run_id}")
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
            rank_zero_warn(
                "ModelCheckpoint(dirpath=None): the default path contains the logger version and changes at every"
                " restart, so auto-resume cannot find earlier checkpoints. Set ModelCheckpoint(dirpath=...)."
            )
