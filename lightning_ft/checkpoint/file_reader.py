"""Which code reads a checkpoint file that a stage loads: the user's ``CheckpointIO`` plugin, or lightning-ft's rule.

Under ``DDPStrategy`` a Trainer given ``plugins=[MyCheckpointIO()]`` reads every checkpoint through the plugin's
``load_checkpoint``; darts' plugin allows darts' classes that way. The strategy names that method for the duration of
one load (:func:`file_reader_scope`), and :func:`load_checkpoint_file` calls it for the file at the checkpoint path
(a lightning-ft file or another strategy's ``.ckpt``); what it admits is the plugin's rule. Without one,
:func:`~lightning_ft.checkpoint.safe_load.load_torch_file` applies: ``weights_only`` plus the classes Lightning
checkpoints commonly hold. Either way the caller checks what comes back (lightning-ft's checksums).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.errors import CorruptCheckpointError
from lightning_ft.checkpoint.file_checks import damaged_records
from lightning_ft.checkpoint.safe_load import load_torch_file

__all__ = ["file_reader_scope", "load_checkpoint_file"]

_file_reader: contextvars.ContextVar[Callable[[Path], Any] | None] = contextvars.ContextVar(
    "lightning_ft_file_reader", default=None
)


@contextmanager
def file_reader_scope(read: Callable[[Path], Any] | None) -> Iterator[None]:
    """Within it, :func:`load_checkpoint_file` reads a checkpoint file with ``read(path)``: the user's
    ``CheckpointIO.load_checkpoint``, called as ``DDPStrategy`` calls it. ``None``: lightning-ft's own rule
    (:func:`load_torch_file`)."""
    token = _file_reader.set(read)
    try:
        yield
    finally:
        _file_reader.reset(token)


def load_checkpoint_file(path: str | os.PathLike, *, mmap: bool = False, weights_only: bool | None = True) -> Any:
    """The checkpoint file at ``path`` (the path Lightning asked to load, a lightning-ft file or another strategy's
    ``.ckpt``), read as the run's ``Trainer`` reads one: by the user's ``CheckpointIO`` plugin within a
    :func:`file_reader_scope`, else by :func:`load_torch_file` (``mmap`` and ``weights_only`` are for that one; the
    plugin was told Lightning's ``weights_only`` by the scope's owner).

    Raises:
        CorruptCheckpointError: the plugin failed and the file's bytes fail the zip's CRC32.
        Exception: the plugin's own error, as it raised it, for an intact file.
        UnsafeCheckpointError: as :func:`load_torch_file`, without a plugin.
    """
    read = _file_reader.get()
    if read is None:
        return load_torch_file(path, mmap=mmap, weights_only=weights_only)
    path = Path(path)
    try:
        return read(path)
    except Exception as e:
        damaged = damaged_records(path)
        if damaged:
            raise CorruptCheckpointError(
                f"{path} is not a readable torch.save file: {', '.join(damaged)} fail(s) the zip's CRC32"
                f" ({type(e).__name__}: {e})"
            ) from e
        raise
