"""Loading a committed checkpoint, on any world size and mesh.

:func:`load_checkpoint` refuses anything not committed, in an unknown format, holding a pickled payload, or with a
missing or corrupt shard, naming the path, the tensor and the file. Tensors in the caller's template are filled in place;
for a DTensor, its local region is computed from its own mesh and placements and assembled from whichever stored shards
overlap it, so a checkpoint written with 2 ranks loads into 1 or 4 ranks (``Shard``/``Replicate`` placements) and an
identical ``_StridedShard`` layout loads back bitwise. Non-tensor values come from the checkpoint's JSON; nothing is
unpickled. Shards are read and checked by :class:`~lightning_ft.checkpoint.shard_reader.ShardReader`. Loading ends with
:func:`~lightning_ft.checkpoint.agreement.agree`: if any rank failed, every rank raises, so all ranks fall back to the
same older checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from argparse import Namespace
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft._compat import DTensor, StridedShard, local_shard_of_full
from lightning_ft.checkpoint import json_codec
from lightning_ft.checkpoint.agreement import agree, is_distributed
from lightning_ft.checkpoint.commit import read_document
from lightning_ft.checkpoint.coverage import coverage_problems
from lightning_ft.checkpoint.discovery import newest_alternative
from lightning_ft.checkpoint.dtensor_geometry import local_region
from lightning_ft.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UncommittedCheckpointError,
)
from lightning_ft.checkpoint.location import CheckpointLocation
from lightning_ft.checkpoint.safe_load import resolve_weights_only, say_unrestricted, weights_only_scope
from lightning_ft.checkpoint.shard_reader import ShardReader
from lightning_ft.checkpoint.single_file import file_version, is_checkpoint_file, load_file
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from lightning_ft.checkpoint.storage.object_store import ObjectStore, is_remote
from lightning_ft.checkpoint.storage.registry import storage_for_path

__all__ = ["LoadedCheckpoint", "load_checkpoint"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns."""

    path: Path
    """The checkpoint directory that was loaded."""
    state: Any
    """The saved nested state: template tensors filled in place, other tensors as new CPU tensors."""
    rank_state: Any
    """The ``rank_state`` saved by rank :attr:`saved_rank` (``None`` if it saved none)."""
    saved_rank: int
    """This rank modulo the saved world size: whose ``rank_state`` this is."""
    metadata: dict[str, Any]
    """The run metadata: ``format_version``, ``step``, ``world_size``, ``size_bytes`` and what the writer added."""
    saved_rank_states: dict[int, Any] = field(default_factory=dict)
    """Other saved ranks' ``rank_state``, by saved rank: those the ``rank_states`` argument asked for."""


def _template_tensors(obj: Any, path: str = "", out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    # Paths are built exactly as json_codec builds them, so a template tensor meets its saved reference.
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _template_tensors(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _template_tensors(v, f"{path}/{i}" if path else str(i), out)
    elif isinstance(obj, Namespace):
        _template_tensors(vars(obj), path, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _template_tensors({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, path, out)
    return out


def _fill(reader: ShardReader, key: str, path: str, target: torch.Tensor | None) -> torch.Tensor:
    record = reader.document["tensors"].get(key)
    if record is None:
        raise CorruptCheckpointError(f"checkpoint {reader.path}: tensor {key!r} is missing from the index")
    global_shape = record["global_shape"]
    if target is None:
        return reader.assemble(key, [0] * len(global_shape), global_shape)
    if list(target.shape) != global_shape:
        raise CheckpointError(
            f"checkpoint {reader.path}: tensor {path!r} has shape {global_shape} in the checkpoint but "
            f"{list(target.shape)} in the state to load into"
        )
    if isinstance(target, DTensor):
        if target.device_mesh.get_coordinate() is None:
            return target
        shape, offset = local_region(target.shape, target.device_mesh, target.placements)
        local = target.to_local()
        with torch.no_grad():
            if list(local.shape) != list(shape) or not reader.read_into(key, offset, local.detach()):
                local.copy_(reader.assemble(key, offset, shape))
        return target
    with torch.no_grad():
        offset = [0] * len(global_shape)
        if not reader.read_into(key, offset, target.detach()):
            target.copy_(reader.assemble(key, offset, global_shape))
    return target


def _load_document(
    path: Path,
    document: dict[str, Any],
    storage: SnapshotStorage | None,
    remote: bool,
    verify_checksums: bool,
    state: Any,
    rank: int,
    rank_states: Callable[[dict[str, Any]], Iterable[int]] | None,
) -> LoadedCheckpoint:
    """A checkpoint folder (or a version-1 file): its document decoded, its tensors read from the shards."""
    problems = coverage_problems(document)
    if problems:
        raise CorruptCheckpointError(f"checkpoint {path} cannot be loaded: {'; '.join(problems)}")
    reader = ShardReader(
        path,
        document,
        storage or (ObjectStore() if remote else storage_for_path(path)),
        verify_checksums=verify_checksums,
    )
    templates = _template_tensors(state) if state is not None else {}
    state_out = json_codec.decode(
        document["state"], lambda key, p: _fill(reader, key, p, templates.get(p) if p in templates else None)
    )
    metadata = json_codec.decode(document["metadata"])
    rank_states_doc = document["rank_states"]
    saved_rank = rank % len(rank_states_doc)
    rank_state = json_codec.decode(rank_states_doc[saved_rank], lambda key, p: _fill(reader, key, p, None))
    others = {}
    for other in rank_states(metadata) if rank_states is not None else ():
        if not 0 <= other < len(rank_states_doc):
            raise CheckpointError(f"checkpoint {path}: no rank {other} among its {len(rank_states_doc)} ranks")
        others[other] = json_codec.decode(rank_states_doc[other], lambda key, p: _fill(reader, key, p, None))
    return LoadedCheckpoint(
        path=path,
        state=state_out,
        rank_state=rank_state,
        saved_rank=saved_rank,
        metadata=metadata,
        saved_rank_states=others,
    )


def _into_templates(obj: Any, templates: dict[str, torch.Tensor], path: str = "") -> Any:
    """``obj`` with each tensor that has a template of its shape (by the same paths as :func:`_template_tensors`)
    copied into that template and replaced by it, as a folder's load fills templates in place."""
    if isinstance(obj, torch.Tensor):
        target = templates.get(path)
        if target is None or target.shape != obj.shape:
            return obj
        if isinstance(target, DTensor):
            # A file of full tensors (sharded_file): this rank's slice of it, read from the memory-mapped file.
            if target.device_mesh.get_coordinate() is None:
                return target
            if any(isinstance(p, StridedShard) for p in target.placements):
                piece = local_shard_of_full(obj, target)
            else:  # a box: only its bytes of the file are read
                shape, offset = local_region(target.shape, target.device_mesh, target.placements)
                piece = obj
                for dim, (start, size) in enumerate(zip(offset, shape, strict=True)):
                    piece = piece.narrow(dim, start, size)
            with torch.no_grad():
                target.to_local().copy_(piece)
            return target
        with torch.no_grad():
            target.copy_(obj)
        return target
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _into_templates(v, templates, f"{path}/{k}" if path else str(k))
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = _into_templates(v, templates, f"{path}/{i}" if path else str(i))
        return obj
    if isinstance(obj, tuple):
        items = [_into_templates(v, templates, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else tuple.__new__(type(obj), items)
    return obj


def _load_file(path: Path, state: Any, weights_only: bool, rank: int) -> LoadedCheckpoint:
    """A version-2 checkpoint file: Lightning's dict as Lightning loads it; the template's tensors filled in place;
    the rank state of saved rank ``rank`` modulo the saved world size (a file written by several processes keeps
    every rank's)."""
    checkpoint, rank_state, metadata, _ = load_file(path, weights_only=weights_only, rank=rank)
    templates = _template_tensors(state) if state is not None else {}
    if templates:
        checkpoint = _into_templates(checkpoint, templates)
    saved_world = metadata.get("world_size")
    saved_rank = rank % saved_world if isinstance(saved_world, int) and saved_world > 0 else 0
    return LoadedCheckpoint(
        path=path, state=checkpoint, rank_state=rank_state, saved_rank=saved_rank, metadata=metadata
    )


def load_checkpoint(
    path: str | os.PathLike | CheckpointLocation,
    state: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    verify_checksums: bool = True,
    storage: SnapshotStorage | None = None,
    collective: bool = True,
    rank_states: Callable[[dict[str, Any]], Iterable[int]] | None = None,
    weights_only: bool | None = None,
) -> LoadedCheckpoint:
    """Load committed checkpoint ``path``, filling the tensors of the template ``state`` in place.

    Collective over ``group`` (default: the default group) when torch.distributed is initialized: every rank calls,
    and if any rank fails, every rank raises. Do not call it while an :class:`AsyncCheckpointer` save on the same group is
    in flight. ``collective=False`` loads in this process alone (any one rank may call it).
    ``rank_states``, given the checkpoint's metadata, names saved ranks whose ``rank_state`` this rank
    also needs (a pipeline stage saved by one data-parallel replica, say); they are read into
    :attr:`LoadedCheckpoint.saved_rank_states`. ``path`` may be an object-store URL (``s3://...``, or a ``Path`` made
    from one): a checkpoint that :class:`~lightning_ft.checkpoint.storage.ObjectStoreCheckpointer` wrote there loads
    the same way. ``path`` may also be a :class:`~lightning_ft.checkpoint.location.CheckpointLocation` of a
    lightning-ft checkpoint (what :func:`~lightning_ft.checkpoint.location.locate` found): its ``path`` is read, and
    what the location already says (local or remote, a folder that exists) is not looked up again.
    ``weights_only`` follows Lightning's ``fit/validate/test/predict(..., weights_only=...)``
    (:func:`~lightning_ft.checkpoint.safe_load.resolve_weights_only`: ``None`` is ``True`` on torch >= 2.6): with
    ``False`` the objects a checkpoint stores load as ``torch.load(weights_only=False)`` loads them (said once).

    A checkpoint file (one process) is Lightning's own file: it loads as Lightning loads it, edits included
    (:func:`~lightning_ft.checkpoint.single_file.load_file`); lightning-ft's record adds the per-process state.

    Raises:
        CheckpointNotFoundError: nothing exists at ``path`` (an ``UncommittedCheckpointError`` and a
            ``FileNotFoundError``).
        UncommittedCheckpointError: ``path`` is not a directory or has no commit marker.
        FormatVersionError: unknown format version.
        UnsafeCheckpointError: the checkpoint holds pickled payloads.
        CorruptCheckpointError: a shard is missing or fails its checksum (the tensor key and file are named), or the
            stored shards do not cover a tensor of the index.
        CheckpointError: the template does not match (shape), or another rank failed.
    """
    location = path if isinstance(path, CheckpointLocation) else None
    path = location.path if location is not None else Path(path)
    remote = location.remote if location is not None else is_remote(path)
    rank = dist.get_rank(group) if is_distributed() else 0
    error: BaseException | None = None
    loaded = None
    try:
        if location is not None and not location.ours:
            raise UncommittedCheckpointError(f"checkpoint {path} is not a lightning-ft checkpoint ({location.kind})")
        if remote:
            document = ObjectStore().read_document(path)
        elif not path.exists():
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
        elif not path.is_dir() and not is_checkpoint_file(path):
            raise UncommittedCheckpointError(f"checkpoint {path} is a file, not a lightning-ft checkpoint")
        elif not path.is_dir() and file_version(path) != 1:
            document = None  # Lightning's own file: Lightning's dict is the state
        else:
            document = read_document(path)
        if document is None:
            loaded = _load_file(path, state, resolve_weights_only(weights_only), rank)
        else:
            if not resolve_weights_only(weights_only):
                say_unrestricted(f"loading {path}")
            with weights_only_scope(weights_only):
                loaded = _load_document(path, document, storage, remote, verify_checksums, state, rank, rank_states)
    except CheckpointError as e:
        named = str(e) if str(path) in str(e) else f"checkpoint {path}: {e}"  # a stored object's refusal names its key
        error = type(e)(f"{named}{newest_alternative(path)}")
        error.__dict__.update(e.__dict__)  # what the refusal carries for its callers (the globals to allow)
        error.__cause__ = e.__cause__
    except Exception as e:  # noqa: BLE001 - still agree with the other ranks before raising
        error = e
    if not collective:
        if error is not None:
            raise error
    else:
        agree(error, group=group, what="loading", error_type=CheckpointError, keep_type=True)
    assert loaded is not None
    return loaded
