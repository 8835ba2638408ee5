"""Finding checkpoints that other Lightning strategies wrote into a checkpoint folder, for auto-resume.

A run that switches to ``ElasticFT3D`` keeps its ``ModelCheckpoint(dirpath=...)``; the folder then holds the files of
the earlier strategy: ``.ckpt`` files (``DDPStrategy`` and every single-file strategy) and distributed checkpoint folders
(``ModelParallelStrategy``: DCP shards plus ``meta.pt``). :func:`list_foreign` reads only what choosing needs (the global
step and whether the full training state is there), through the same safe loading as the import itself: a ``.ckpt``
is opened with ``mmap=True``, so its tensors are not read.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from lightning_ft.checkpoint.commit import COMMIT_MARKER, METADATA_FILE
from lightning_ft.checkpoint.dcp_folder import LIGHTNING_META, is_dcp_folder
from lightning_ft.checkpoint.errors import CheckpointError
from lightning_ft.checkpoint.safe_load import load_torch_file
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from lightning_ft.checkpoint.storage.dcp_storage import ENTRIES_FILE

__all__ = ["ForeignCheckpointInfo", "list_foreign"]


@dataclass(frozen=True)
class ForeignCheckpointInfo:
    """A checkpoint of another Lightning strategy found in a folder."""

    path: Path
    """The ``.ckpt`` file or the distributed checkpoint folder."""
    step: int | None
    """Its ``global_step``."""
    mtime: float
    """Modification time (of ``meta.pt`` for a folder), Unix seconds."""
    full_state: bool
    """Whether it holds optimizer and loop state (``save_weights_only=False``)."""


def _is_ours(path: Path) -> bool:
    return any((path / name).exists() for name in (COMMIT_MARKER, METADATA_FILE, ENTRIES_FILE))


def list_foreign(dirpath: str | os.PathLike) -> list[ForeignCheckpointInfo]:
    """The ``.ckpt`` files and Lightning distributed checkpoint folders directly under ``dirpath``, by step ascending.

    Symlinks and lightning-ft checkpoints are skipped; a file that cannot be read safely is skipped with a warning that
    says why (it can still be given as ``ckpt_path`` once its classes are allowed). Not collective.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found = []
    for child in sorted(dirpath.iterdir()):
        if child.is_symlink():
            continue
        if child.is_file() and child.suffix == ".ckpt":
            if is_checkpoint_file(child):
                continue  # a checkpoint file lightning-ft wrote: listed with the committed ones
            source = child
        elif child.is_dir() and is_dcp_folder(child) and (child / LIGHTNING_META).is_file() and not _is_ours(child):
            source = child / LIGHTNING_META
        else:
            continue
        try:
            checkpoint = load_torch_file(source, mmap=True)
        except (CheckpointError, OSError, RuntimeError) as e:
            warnings.warn(f"lightning-ft auto-resume: skipping {child}: {e}", stacklevel=2)
            continue
        if not isinstance(checkpoint, dict) or "loops" not in checkpoint and "state_dict" not in checkpoint:
            continue
        step = checkpoint.get("global_step")
        full = "loops" in checkpoint and ("optimizer_states" in checkpoint or source.name == LIGHTNING_META)
        found.append(
            ForeignCheckpointInfo(
                path=child, step=step if isinstance(step, int) else None, mtime=source.stat().st_mtime, full_state=full
            )
        )
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.mtime))
