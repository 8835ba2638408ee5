"""Asynchronous, sharded, atomically committed checkpoints through torchsnapshot.

See docs/checkpointing.md. The strategy drives :class:`AsyncCheckpointer` and :func:`load_checkpoint`; auto-resume and
retention use the discovery functions; the ``lightning-ft inspect`` and ``export`` commands use :func:`describe`,
:func:`format_description` and :func:`export_state_dict`; :func:`load_from_checkpoint` puts a checkpoint into a
``LightningModule`` for inference.

Modules: ``async_checkpointer`` (the save: capture, background write, commit), ``staging`` (the capture),
``ownership`` (which rank writes which region), ``agreement`` (raise on every rank if one failed), ``commit`` (the
on-disk contract), ``coverage`` (the index check at commit and in ``verify``), ``in_progress`` (what lightning-ft may
delete: the in-progress record, saves in flight), ``swap`` (replacing a committed checkpoint, and recovery after a
crash), ``snapshot_storage`` (the torchsnapshot seam), ``shard_reader`` and ``load`` (reading back), ``discovery`` and
``retention`` (finding and deleting checkpoints), ``dtensor_geometry``, ``json_codec``, ``inspect``; interoperability:
``export`` and ``torch_file`` (a plain Lightning file out, streamed), ``safe_load`` (Lightning files in, without
unrestricted unpickling), ``dcp_folder`` (``ModelParallelStrategy`` folders in), ``foreign_discovery``, ``rank_state``;
``module_loader`` (into a ``LightningModule``); ``storage`` (the DCP format, object storage).
"""

from __future__ import annotations

from lightning_ft.checkpoint.async_checkpointer import AsyncCheckpointer, CommitInfo
from lightning_ft.checkpoint.commit import FORMAT_VERSION, METADATA_FILE
from lightning_ft.checkpoint.discovery import (
    COMMIT_MARKER,
    CheckpointInfo,
    cleanup_uncommitted,
    is_committed,
    latest_committed,
    list_committed,
    read_metadata,
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
from lightning_ft.checkpoint.export import export_checkpoint, export_state_dict, exported_checkpoint
from lightning_ft.checkpoint.in_progress import IN_PROGRESS_RECORD
from lightning_ft.checkpoint.inspect import describe, format_description
from lightning_ft.checkpoint.load import LoadedCheckpoint, load_checkpoint
from lightning_ft.checkpoint.module_loader import load_from_checkpoint
from lightning_ft.checkpoint.retention import Retention
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

__all__ = [
    "AsyncCheckpointer",
    "COMMIT_MARKER",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CommitInfo",
    "CorruptCheckpointError",
    "FORMAT_VERSION",
    "FormatVersionError",
    "IN_PROGRESS_RECORD",
    "LoadedCheckpoint",
    "METADATA_FILE",
    "Retention",
    "SnapshotStorage",
    "UncommittedCheckpointError",
    "UnsafeCheckpointError",
    "cleanup_uncommitted",
    "describe",
    "export_checkpoint",
    "export_state_dict",
    "exported_checkpoint",
    "format_description",
    "is_committed",
    "latest_committed",
    "list_committed",
    "load_checkpoint",
    "load_from_checkpoint",
    "read_metadata",
    "recover_interrupted_swaps",
    "repoint_last",
    "verify",
]
