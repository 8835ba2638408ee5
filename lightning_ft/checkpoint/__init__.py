"""Asynchronous, sharded, atomically committed checkpoints through torchsnapshot.

The public names below are the ones docs/checkpointing.md teaches: the writer and reader (:class:`AsyncCheckpointer`,
:func:`load_checkpoint`, :func:`load_from_checkpoint`), finding and settling checkpoints on disk, and the errors a
refused load raises. What the strategy, fault handling and the CLI use beyond them is in
:mod:`lightning_ft.checkpoint.internal` (not API).

Modules: ``async_checkpointer`` (the save: capture, background write, commit), ``staging`` (the capture),
``ownership`` (which rank writes which region), ``agreement`` (raise on every rank if one failed), ``commit`` (the
on-disk contract), ``coverage`` (the index check at commit and in ``verify``), ``in_progress`` (what lightning-ft may
delete: the in-progress record, saves in flight), ``swap`` (replacing a committed checkpoint, and recovery after a
crash), ``snapshot_storage`` (the torchsnapshot seam), ``shard_reader`` and ``load`` (reading back), ``discovery`` and
``retention`` (finding and deleting checkpoints), ``dtensor_geometry``, ``json_codec``, ``inspect``; interoperability:
``export`` and ``torch_file`` (a plain Lightning file out, streamed), ``safe_load`` (Lightning files in, without
unrestricted unpickling), ``file_reader`` (or through the user's ``CheckpointIO``), ``dcp_folder`` (``ModelParallelStrategy`` folders in), ``foreign_discovery``, ``rank_state``;
``module_loader`` (into a ``LightningModule``); ``memory_tier`` and ``memory_copies`` (the in-memory tier's
configuration and copies); ``storage`` (the DCP format, object storage).
"""

from __future__ import annotations

from lightning_ft.checkpoint.async_checkpointer import AsyncCheckpointer
from lightning_ft.checkpoint.discovery import (
    CheckpointInfo,
    cleanup_uncommitted,
    latest_committed,
    list_committed,
    recover_interrupted_swaps,
    repoint_last,
    verify,
)
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    FormatVersionError,
    UncommittedCheckpointError,
    UnsafeCheckpointError,
)
from lightning_ft.checkpoint.load import LoadedCheckpoint, load_checkpoint
from lightning_ft.checkpoint.memory_tier import MemoryTier
from lightning_ft.checkpoint.module_loader import load_from_checkpoint

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "LoadedCheckpoint",
    "MemoryTier",
    "UncommittedCheckpointError",
    "UnsafeCheckpointError",
    "cleanup_uncommitted",
    "latest_committed",
    "list_committed",
    "load_checkpoint",
    "load_from_checkpoint",
    "recover_interrupted_swaps",
    "repoint_last",
    "verify",
]
