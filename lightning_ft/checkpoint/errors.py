"""Errors raised by lightning-ft checkpoints.

Every refusal to load or to commit a checkpoint is a :class:`CheckpointError`, so callers such as auto-resume can catch one
type, log a ``checkpoint_rejected`` event and fall back to an older checkpoint. The subclasses say why; their messages name
the checkpoint path and, where one exists, the newest committed alternative in the same folder. The same types reach the
user through ``trainer.fit(ckpt_path=...)`` (and ``validate``/``test``/``predict``) and through
:func:`~lightning_ft.checkpoint.load_from_checkpoint`; docs/checkpointing.md lists which situation raises which.
"""

from __future__ import annotations

import pickle


class CheckpointError(RuntimeError):
    """Base class: the checkpoint cannot be written or read as asked."""


class UncommittedCheckpointError(CheckpointError):
    """The directory has no commit marker (its save never finished), or is not a lightning-ft checkpoint at all."""


class CheckpointNotFoundError(UncommittedCheckpointError, FileNotFoundError):
    """Nothing exists at the checkpoint path. Also a ``FileNotFoundError``, so either ``except`` clause catches it."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written in a format version this release cannot read."""


class CorruptCheckpointError(CheckpointError):
    """A shard is missing or its checksum does not match, or the metadata is unreadable."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The checkpoint needs globals that are not allowed (``weights_only=True``, the default): the message prints the
    code that allows them; ``weights_only=False`` loads it as Lightning would. Also a ``pickle.UnpicklingError``, what
    ``torch.load(weights_only=True)`` raises in the same case under ``DDPStrategy``, so code written for it catches
    this too."""


class CheckpointWriteError(CheckpointError):
    """A background save failed on another rank; this rank's copy of the error names that rank and its message."""
