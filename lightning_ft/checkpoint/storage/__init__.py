"""Storages behind the checkpoint seam besides torchsnapshot: :class:`DcpStorage` (PyTorch's distributed checkpoint
layout, ``ElasticFT3D(checkpoint_format="dcp")``) and :class:`ObjectStore` (fsspec object storage, commit without
rename or link). The writer that routes saves to object-store URLs or folders, and the format registry, are reached
through :mod:`lightning_ft.checkpoint.internal` (not API)."""

from __future__ import annotations

from lightning_ft.checkpoint.storage.dcp_storage import DcpStorage
from lightning_ft.checkpoint.storage.object_store import ObjectStore

__all__ = [
    "DcpStorage",
    "ObjectStore",
]
