"""Storages behind the checkpoint seam besides torchsnapshot: :class:`DcpStorage` (PyTorch's distributed checkpoint
layout) and :class:`ObjectStore` (fsspec object storage, commit without rename or link)."""

from __future__ import annotations

from lightning_ft.checkpoint.storage.dcp_storage import DcpReader, DcpStorage, EntryLayout
from lightning_ft.checkpoint.storage.object_store import ObjectCheckpointInfo, ObjectReader, ObjectStore
from lightning_ft.checkpoint.storage.registry import FORMATS, storage_for_path, storage_named

__all__ = [
    "FORMATS",
    "DcpReader",
    "DcpStorage",
    "EntryLayout",
    "ObjectCheckpointInfo",
    "ObjectReader",
    "ObjectStore",
    "storage_for_path",
    "storage_named",
]
