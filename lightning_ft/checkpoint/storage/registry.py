"""Which storage reads a checkpoint folder, and the storage a format name stands for.

A lightning-ft checkpoint's data is written by one storage of the seam: torchsnapshot (``.snapshot_metadata``) or DCP
(``.metadata`` plus :data:`~lightning_ft.checkpoint.storage.dcp_storage.ENTRIES_FILE`). Readers that are not told
which one wrote it ask :func:`storage_for_path`, which looks at those files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_ft.checkpoint.single_file import FileStorage
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from lightning_ft.checkpoint.storage.dcp_storage import ENTRIES_FILE, DcpStorage
from lightning_ft.checkpoint.storage.object_store import ObjectStore, is_remote

__all__ = ["FORMATS", "format_choice", "resolve_format", "storage_for_path", "storage_named"]

FORMATS = ("torchsnapshot", "dcp", "file", "auto")
"""The on-disk formats ``ElasticFT3D(checkpoint_format=...)`` accepts: ``"auto"`` picks ``"file"`` for plain
(data-parallel, non-DTensor, non-pipeline) state at any process count, ``"torchsnapshot"`` folders for DTensor or
pipeline state (:func:`resolve_format`); ``"file"`` is accepted for plain state only."""


def resolve_format(name: str, *, plain: bool, owner: str = "ElasticFT3D") -> str:
    """The format a run writes with: ``name``, or for ``"auto"`` the single ``torch.save`` file when the state is plain
    (a file can hold it: one process, data-parallel replicas, or DTensors whose shards are contiguous byte ranges,
    :mod:`~lightning_ft.checkpoint.sharded_file`; at several processes every rank writes its share of the one file),
    else torchsnapshot folders (other DTensor placements, pipeline state). The one place this rule lives;
    :func:`format_choice` says it.

    Raises:
        ValueError: ``name`` is ``"file"`` and the state holds DTensors or pipeline stages (a file holds state every
            rank holds in full); or ``name`` is unknown.
    """
    if name == "auto":
        return "file" if plain else "torchsnapshot"
    if name == "file" and not plain:
        raise ValueError(
            f"{owner}(checkpoint_format='file'): a checkpoint file holds state every rank holds in full (a single"
            " process, or data-parallel replicas), and this run holds DTensor or pipeline state;"
            " use 'auto' (the file for data-parallel state, folders otherwise), 'torchsnapshot' or 'dcp'"
        )
    storage_named(name, owner=owner)
    return name


def format_choice(
    name: str,
    *,
    plain: bool,
    world_size: int,
    remote: bool = False,
    owner: str = "ElasticFT3D",
    why: str | None = None,
) -> str:
    """One line for the console at set-up: the format :func:`resolve_format` picks for ``name`` and why (``remote``:
    a checkpoint folder is an object-store URL, which keeps its own folders whatever the format; ``why``: what in the
    state decided ``"auto"``'s choice, where the caller knows better than "data-parallel" or "DTensor or pipeline")."""
    chosen = resolve_format(name, plain=plain, owner=owner)
    if remote:
        return (
            "lightning-ft: checkpoints are folders of objects (the ModelCheckpoint dirpath is an object-store URL,"
            " whose commit needs no rename)"
        )
    shares = f", written by all {world_size} ranks in parallel" if world_size > 1 else ""
    what = {
        "file": f"torch.save files, the file Lightning writes{shares}",
        "torchsnapshot": "torchsnapshot folders, sharded across the ranks",
        "dcp": "folders in PyTorch's distributed checkpoint (DCP) layout",
    }[chosen]
    if name != "auto":
        why = f"checkpoint_format={name!r}"
    elif why is not None:
        why = f"checkpoint_format='auto': {why}"
    elif plain:
        held = "which every rank holds in full" if world_size > 1 else "no DTensor, no pipeline stage"
        why = f"checkpoint_format='auto': data-parallel state, {held}"
    else:
        why = (
            "checkpoint_format='auto': DTensor or pipeline state, which each rank holds only a shard of;"
            " a file holds state every rank holds in full"
        )
    return f"lightning-ft: checkpoints are {what} ({why})"


def storage_named(name: str, *, owner: str | None = None) -> Any:
    """A new storage for format ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`FORMATS`; the message shows the option as the user typed it, inside
            ``owner`` (``ElasticFT3D``) when given.
    """
    if name == "torchsnapshot":
        return SnapshotStorage()
    if name == "dcp":
        return DcpStorage()
    if name == "file":
        return FileStorage()
    if name == "auto":
        return FileStorage()  # until the run's state is known (resolve_format), as the file it is for plain state
    option = f"checkpoint_format={name!r}"
    raise ValueError(f"{f'{owner}({option})' if owner else option}: must be one of {', '.join(map(repr, FORMATS))}")


def storage_for_path(path: str | os.PathLike) -> Any:
    """The storage that reads the checkpoint ``path``: an :class:`ObjectStore` for an object-store URL, DCP for a folder
    holding DCP's entry table, else torchsnapshot."""
    if is_remote(path):
        return ObjectStore()
    if Path(path).is_file():
        return FileStorage()
    return DcpStorage() if (Path(path) / ENTRIES_FILE).is_file() else SnapshotStorage()
