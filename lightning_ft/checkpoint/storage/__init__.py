"""Storages behind the checkpoint seam besides torchsnapshot: :class:`DcpStorage` (PyTorch's distributed checkpoint
layout) and :class:`ObjectStore` (fsspec object storage, commit without rename or link), with
:class:`ObjectStoreCheckpointer`, the writer that saves to object-store URLs as well as to folders."""

from __future__ import annotations

from lightning_ft.checkpoint.storage.dcp_storage import DcpReader, DcpStorage, EntryLayout
from lightning_ft.checkpoint.storage.object_checkpointer import ObjectStoreCheckpointer, RoutedStorage
from lightning_ft.checkpoint.storage.object_store import (
    ObjectCheckpointInfo,
    ObjectCommit,
    ObjectReader,
    ObjectStore,
    as_url,
    is_remote,
)
from lightning_ft.checkpoint.storage.registry import FORMATS, storage_for_path, storage_named

__all__ = [
    "FORMATS",
    "DcpReader",
    "DcpStorage",
    "EntryLayout",
    "ObjectCheckpointInfo",
    "ObjectReader",
    "ObjectCommit",
    "ObjectStore",
    "ObjectStoreCheckpointer",
    "RoutedStorage",
    "as_url",
    "is_remote",
    "storage_for_path",
    "storage_named",
]
