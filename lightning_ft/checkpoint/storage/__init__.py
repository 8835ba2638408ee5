"""Storages behind the checkpoint seam besides torchsnapshot: :class:`DcpStorage` (PyTorch's distributed checkpoint
layout) and :class:`ObjectStore` (fsspec object storage, commit without rename or link)."""

from __future__ import annotations

from lightning_ft.checkpoint.storage.dcp_storage import DcpReader, DcpStorage, EntryLayout
from lightning_ft.checkpoint.storage.object_store import ObjectCheckpointInfo, ObjectReader, ObjectStore

__all__ = ["DcpReader", "DcpStorage", "EntryLayout", "ObjectCheckpointInfo", "ObjectReader", "ObjectStore"]
