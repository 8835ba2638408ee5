"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.checkpoint` (docs/); these may change in any release. The architecture test allows this module to
be imported only by the packages that may import ``checkpoint`` (tests/test_architecture.py, ``ALLOWED``) and by the
tests.

The strategy's checkpoint I/O reads the on-disk names, drives :class:`Retention` and the storages, and imports
foreign checkpoints; fault handling finds the newest committed checkpoint and wraps :class:`SnapshotStorage`; the
CLI's ``inspect`` and ``export`` call :func:`describe`, :func:`format_description` and :func:`export_checkpoint`.
"""

from __future__ import annotations

from lightning_ft.checkpoint import discovery
from lightning_ft.checkpoint.async_checkpointer import CommitInfo
from lightning_ft.checkpoint.commit import FORMAT_VERSION, METADATA_FILE
from lightning_ft.checkpoint.dcp_folder import is_dcp_folder, load_dcp, read_lightning_dcp_meta
from lightning_ft.checkpoint.discovery import COMMIT_MARKER, is_committed, read_metadata
from lightning_ft.checkpoint.export import export_checkpoint, export_state_dict, exported_checkpoint
from lightning_ft.checkpoint.file_commit import writes_files
from lightning_ft.checkpoint.file_reader import file_reader_scope, load_checkpoint_file
from lightning_ft.checkpoint.foreign_discovery import list_foreign
from lightning_ft.checkpoint.in_progress import IN_PROGRESS_RECORD, discard
from lightning_ft.checkpoint.inspect import describe, format_description
from lightning_ft.checkpoint.location import (
    CheckpointLocation,
    existing_ancestor,
    is_last_path,
    is_lightning_ft_checkpoint,
    listed,
    locate,
)
from lightning_ft.checkpoint.memory_copies import (
    MemoryCopy,
    capture_own,
    check_copy,
    copy_folder,
    list_copies,
    load_copy,
    pack,
    remove_others,
    run_folder,
    unpack,
    write_copy,
)
from lightning_ft.checkpoint.memory_tier import MEMORY_DIR_ENV, MemoryTier
from lightning_ft.checkpoint.rank_state import read_rank_state
from lightning_ft.checkpoint.retention import Retention
from lightning_ft.checkpoint.safe_load import (
    load_pickled,
    load_torch_file,
    pickled_bytes,
    resolve_weights_only,
)
from lightning_ft.checkpoint.sampler_positions import without_sampler_states
from lightning_ft.checkpoint.sharded_file import file_refusal
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from lightning_ft.checkpoint.staging import Stager
from lightning_ft.checkpoint.storage.dcp_storage import ENTRIES_FILE, DcpReader, EntryLayout
from lightning_ft.checkpoint.storage.memory_files import MemoryFileStorage
from lightning_ft.checkpoint.storage.object_checkpointer import ObjectStoreCheckpointer, RoutedStorage
from lightning_ft.checkpoint.storage.object_store import (
    ObjectCheckpointInfo,
    ObjectCommit,
    ObjectReader,
    as_url,
    is_remote,
    protocol_of,
)
from lightning_ft.checkpoint.storage.registry import (
    FORMATS,
    format_choice,
    resolve_format,
    storage_for_path,
    storage_named,
)
from lightning_ft.checkpoint.unfinished import UnfinishedSave, unfinished_saves
from lightning_ft.checkpoint.writer_threads import lower_thread_priority

__all__ = [
    "COMMIT_MARKER",
    "CheckpointLocation",
    "CommitInfo",
    "DcpReader",
    "ENTRIES_FILE",
    "EntryLayout",
    "FORMATS",
    "FORMAT_VERSION",
    "IN_PROGRESS_RECORD",
    "MEMORY_DIR_ENV",
    "METADATA_FILE",
    "MemoryCopy",
    "MemoryFileStorage",
    "MemoryTier",
    "ObjectCheckpointInfo",
    "ObjectCommit",
    "ObjectReader",
    "ObjectStoreCheckpointer",
    "Retention",
    "RoutedStorage",
    "SnapshotStorage",
    "Stager",
    "as_url",
    "capture_own",
    "check_copy",
    "copy_folder",
    "describe",
    "discovery",
    "export_checkpoint",
    "export_state_dict",
    "format_choice",
    "existing_ancestor",
    "file_reader_scope",
    "file_refusal",
    "exported_checkpoint",
    "format_description",
    "is_committed",
    "is_dcp_folder",
    "is_last_path",
    "is_lightning_ft_checkpoint",
    "is_remote",
    "list_foreign",
    "list_copies",
    "listed",
    "load_copy",
    "load_dcp",
    "load_checkpoint_file",
    "load_torch_file",
    "load_pickled",
    "pickled_bytes",
    "resolve_weights_only",
    "locate",
    "lower_thread_priority",
    "pack",
    "protocol_of",
    "read_lightning_dcp_meta",
    "read_metadata",
    "read_rank_state",
    "remove_others",
    "run_folder",
    "resolve_format",
    "storage_for_path",
    "storage_named",
    "unpack",
    "without_sampler_states",
    "write_copy",
    "writes_files",
    "UnfinishedSave",
    "discard",
    "unfinished_saves",
]
