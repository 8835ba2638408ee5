"""``ckpt_path="best"`` under ``ElasticFT3D``, in the process that trained and in a fresh one.

Lightning turns ``"best"`` into ``trainer.checkpoint_callback.best_model_path`` inside ``validate``/``test``/
``predict``/``fit`` before any strategy hook runs, and raises when that path is empty, as it is in a fresh process.
The first object of the strategy that sees the trainer in these calls is its launcher, so ``ElasticFT3D`` hooks its
launcher (:func:`lightning_ft._compat.hook_launcher`) with :func:`resolving_best`: for the duration of one call it
installs a :class:`~lightning_ft._compat.Patch` on the trainer's checkpoint-path parser which, when ``"best"`` is asked
for and the callback knows no best path, first restores each ``ModelCheckpoint``'s state from the newest committed
checkpoint in its ``dirpath`` (the state that checkpoint saved: best path, scores, top-k). Lightning then resolves
``"best"`` as it would have in the process that trained. The same patch resolves ``"last"`` when ``ModelCheckpoint``
dirpaths are object-store URLs: to the newest committed checkpoint found by listing their markers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import _compat
from lightning_ft.checkpoint import CheckpointError
from lightning_ft.checkpoint.internal import discovery, read_rank_state
from lightning_ft.strategy.auto_resume import newest_remote_checkpoint

__all__ = ["resolving_best", "restore_checkpoint_callbacks"]


def restore_checkpoint_callbacks(trainer: Any) -> list[ModelCheckpoint]:
    """Load the state of every ``ModelCheckpoint`` that has a ``dirpath`` but no best path yet from the newest committed
    checkpoint in that folder holding its state. Returns the callbacks restored. Reads files only (no collective)."""
    restored = []
    for callback in trainer.checkpoint_callbacks:
        if (
            not isinstance(callback, ModelCheckpoint)
            or not getattr(callback, "dirpath", None)
            or callback.best_model_path
        ):
            continue
        for info in reversed(discovery.list_committed(Path(callback.dirpath))):
            try:
                state = (read_rank_state(info.path) or {}).get("callbacks", {}).get(callback.state_key)
            except CheckpointError:
                continue  # a damaged checkpoint: an older one may still hold the callback's state
            if state:
                callback.load_state_dict(state)
                restored.append(callback)
                break
    return restored


@contextmanager
def resolving_best(trainer: Any) -> Iterator[None]:
    """While a ``Trainer`` entry point runs, make ``ckpt_path="best"`` find the best checkpoint of earlier processes."""
    if trainer is None:
        yield
        return

    def parse(original: Any, state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        callback = trainer.checkpoint_callback
        if ckpt_path == "last" and (newest := newest_remote_checkpoint(trainer)) is not None:
            return newest  # object stores have no `last` link; Lightning's own search cannot list them
        if ckpt_path == "best" and callback is not None and not getattr(callback, "best_model_path", None):
            restore_checkpoint_callbacks(trainer)
        return original(state_fn, ckpt_path, model_provided, model_connected)

    patch = _compat.ckpt_path_parser_patch(trainer, parse, name="lightning-ft ckpt_path='best'").install()
    try:
        yield
    finally:
        patch.undo()
