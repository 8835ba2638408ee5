"""A lightning-ft checkpoint into a ``LightningModule`` for inference, in one line.

A lightning-ft checkpoint of DTensor or pipeline state (or of ``checkpoint_format="torchsnapshot"``/``"dcp"``) is a
folder (``epoch=0-step=100.ckpt/``), which Lightning's own ``MyModule.load_from_checkpoint("checkpoints/last.ckpt")``
cannot read (``IsADirectoryError``); one of data-parallel state, at any process count, is Lightning's own file, read as
Lightning reads it (edits included). :func:`load_from_checkpoint` assembles the full model
tensors from their shards in this one process and hands them to Lightning's own loader, so hyper-parameters,
``on_load_checkpoint`` and ``strict`` behave exactly as they do for a Lightning ``.ckpt`` file. ``lightning-ft export`` writes the same content to a file for use without lightning-ft.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_ft.checkpoint.discovery import is_committed
from lightning_ft.checkpoint.errors import UncommittedCheckpointError
from lightning_ft.checkpoint.export import exported_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["load_from_checkpoint"]

M = TypeVar("M", bound="pl.LightningModule")


def load_from_checkpoint(
    model: type[M] | M,
    path: str | os.PathLike,
    *,
    map_location: Any = None,
    strict: bool = True,
    weights_only: bool | None = None,
    **hparams_overrides: Any,
) -> M:
    """Load committed checkpoint ``path`` into a ``LightningModule`` and return it in eval mode.

    Args:
        model: a ``LightningModule`` class, built from the hyper-parameters saved in the checkpoint (those of
            ``save_hyperparameters()``) updated by ``hparams_overrides``, exactly as Lightning's
            ``MyModule.load_from_checkpoint`` builds it; or an instance, whose weights are replaced in place.
        path: a checkpoint folder, or a ``last`` link (followed; it must point at a committed checkpoint).
        map_location: where the weights go, as for Lightning's ``load_from_checkpoint`` (class only); they are read
            to CPU.
        strict: whether the checkpoint's keys must match the module's ``state_dict()`` keys exactly.
        weights_only: as Lightning's ``load_from_checkpoint(..., weights_only=...)``: ``None`` is torch's default
            (``True``); ``False`` loads the objects the checkpoint stores as ``torch.load(weights_only=False)`` does.
        hparams_overrides: hyper-parameters that replace the saved ones (class only).

    Not collective: one process reads every shard it needs, with or without torch.distributed (any single rank
    may call it). Host memory needed: about three times the model's weights while loading a class, one time for an
    instance. Weights of a tensor-parallel or FSDP2 run come back as full tensors, so the module must hold its full
    layers after ``__init__`` (parallelize them in ``configure_model``, which this does not call).

    Raises:
        CheckpointNotFoundError: nothing exists at ``path`` (also a ``FileNotFoundError``).
        UncommittedCheckpointError: ``path`` (or the target of a ``last`` link) has no commit marker.
        CheckpointError: the checkpoint is corrupt, unsafe, of an unknown format (the subclasses of
            docs/checkpointing.md), or holds no model state.
        TypeError: ``model`` is neither a ``LightningModule`` class nor an instance, or ``map_location`` or
            hyper-parameter overrides were given with an instance.

    Example::

        from lightning_ft import load_from_checkpoint

        model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")
        with torch.no_grad():
            prediction = model(batch)
    """
    import lightning.pytorch as pl

    is_class = isinstance(model, type) and issubclass(model, pl.LightningModule)
    if not is_class and not isinstance(model, pl.LightningModule):
        raise TypeError(f"load_from_checkpoint(model={model!r}): must be a LightningModule class or instance")
    if not is_class and (hparams_overrides or map_location is not None):
        given = ", ".join([*hparams_overrides, *(["map_location"] if map_location is not None else [])])
        raise TypeError(
            f"load_from_checkpoint({type(model).__name__}(...), {str(path)!r}, {given}=...): hyper-parameters and"
            f" map_location apply when building the module; pass the class {type(model).__name__} instead"
        )
    path = _follow_last(Path(path))
    checkpoint = exported_checkpoint(path, weights_only=weights_only)
    if is_class:
        # Lightning's own loader reads a file-like object: hyper-parameters (LightningCLI's included), strict and
        # on_load_checkpoint behave as for any Lightning checkpoint.
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        del checkpoint
        buffer.seek(0)
        # Lightning >= 2.6 takes weights_only (2.5 does not: there torch.load's default applies).
        extra = {"weights_only": weights_only} if weights_only is not None else {}
        loaded = model.load_from_checkpoint(
            buffer, map_location=map_location, strict=strict, **extra, **hparams_overrides
        )
    else:
        loaded = model
        loaded.on_load_checkpoint(checkpoint)
        loaded.load_state_dict(checkpoint["state_dict"], strict=strict)
    loaded.eval()
    return loaded


def _follow_last(path: Path) -> Path:
    """The checkpoint a ``last`` link points at; refused with both names when that one is not committed."""
    if not path.is_symlink():
        return path
    target = path.resolve()
    if target.exists() and not is_committed(target):
        raise UncommittedCheckpointError(
            f"checkpoint {path} points at {target}, which is not committed (its save never finished)"
        )
    return target
