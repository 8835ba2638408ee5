"""Reading a PyTorch distributed checkpoint (DCP) folder, such as Lightning's ``ModelParallelStrategy`` writes, safely.

``torch.distributed.checkpoint`` reads its ``.metadata`` file with ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``: both unrestricted. This module reads the same folders without either:

- :func:`read_dcp_metadata` unpickles ``.metadata`` with an unpickler that resolves only DCP's own metadata classes,
  torch dtypes, sizes and layouts (anything else is refused);
- :func:`load_dcp` fills a template state dict in place through DCP's own planner and reader (so a checkpoint written
  with one sharding loads into another: DCP reshards), with non-tensor values read by ``torch.load(weights_only=True)``.
  It runs on each rank alone (no collective): every rank reads the chunks its template needs;
- :func:`read_lightning_dcp_meta` reads Lightning's ``meta.pt`` beside the shards (loops, callbacks, schedulers, ...)
  through :func:`~lightning_ft.checkpoint.safe_load.load_torch_file`.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_ft import _compat
from lightning_ft.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from lightning_ft.checkpoint.safe_load import default_safe_globals, load_torch_file

__all__ = [
    "DCP_METADATA",
    "LIGHTNING_META",
    "is_dcp_folder",
    "load_dcp",
    "read_dcp_metadata",
    "read_lightning_dcp_meta",
]

DCP_METADATA = ".metadata"
"""DCP's own metadata file in a checkpoint folder."""
LIGHTNING_META = "meta.pt"
"""The file Lightning's ``ModelParallelStrategy`` (and ``FSDPStrategy``) writes beside the shards: everything that is
not model or optimizer state."""


def is_dcp_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a DCP ``.metadata`` file."""
    return (Path(path) / DCP_METADATA).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(f"{module}.{name} is not a DCP metadata class")
        return found


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint folder ``path``, unpickled with only DCP's metadata classes allowed.

    Raises:
        CorruptCheckpointError: no ``.metadata`` file, or it cannot be read.
        UnsafeCheckpointError: it names a class that is not part of DCP's metadata.
    """
    file = Path(path) / DCP_METADATA
    if not file.is_file():
        raise CorruptCheckpointError(f"{path}: no {DCP_METADATA} file (not a distributed checkpoint folder)")
    allowed = dict(_compat.dcp_metadata_globals())
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("set", "frozenset", "tuple", "list", "dict"):
        allowed[("builtins", name)] = getattr(builtins, name)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes()), allowed).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{file}: {e}; lightning-ft never unpickles arbitrary objects") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickles raise many types
        raise CorruptCheckpointError(f"{file} is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{file} does not hold DCP metadata (found {type(metadata).__name__})")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's filesystem reader with :func:`read_dcp_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(_new_globals()):
            obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _new_globals() -> list[Any]:
    present = torch.serialization.get_safe_globals()
    return [g for g in default_safe_globals() if g not in present]


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    target = root
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def load_dcp(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Fill the tensors of the nested ``state`` in place from the DCP folder ``path`` (non-tensor values replaced).

    Tensors may be DTensors laid out differently from the checkpoint: each rank reads the chunks overlapping its own
    local shards. Not collective: any rank (or a single process) may call it on its own. Keys of ``state`` missing from
    the checkpoint raise; keys of the checkpoint not in ``state`` are not read.

    Raises:
        CorruptCheckpointError: the folder is not a readable DCP checkpoint, or lacks a key of ``state``.
        UnsafeCheckpointError: its metadata or a non-tensor value names a class that is not allowed.
    """
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is what we ask for
            dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafePlanner(), no_dist=True)
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures in CheckpointException
        raise CorruptCheckpointError(f"distributed checkpoint {path}: {type(e).__name__}: {e}") from e


def read_lightning_dcp_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of the DCP folder ``path``: the checkpoint dict without model and optimizer state.

    Raises:
        CorruptCheckpointError: the folder has no ``meta.pt`` (not written by a Lightning strategy).
        UnsafeCheckpointError: as :func:`~lightning_ft.checkpoint.safe_load.load_torch_file`.
    """
    meta = Path(path) / LIGHTNING_META
    if not meta.is_file():
        raise CorruptCheckpointError(
            f"{path}: a distributed checkpoint folder without Lightning's {LIGHTNING_META} (not written by a Lightning"
            " strategy); the loop, callback and scheduler state it would hold is missing"
        )
    loaded = load_torch_file(meta)
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{meta} does not hold a dict")
    return loaded
