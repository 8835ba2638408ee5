"""Whether a checkpoint's index is loadable: every tensor it refers to is covered exactly by its stored shards.

The writer checks the index it is about to commit (a checkpoint that cannot load is never committed), and
:func:`~lightning_ft.checkpoint.verify` (so ``lightning-ft inspect``) reports the same problems for one on disk. The rules:

- every tensor reference in the shared state and in each rank's ``rank_state`` names a tensor of the index, and there is
  one ``rank_state`` per rank of the world that wrote it;
- each tensor's shards lie inside its global shape, have its number of dimensions, hold the bytes their shape and dtype
  need, do not overlap, and together cover every element.

Ranks that pass tensors of different shapes under one key of the shared state break the last rule (their shards
disagree with the shape rank 0 recorded); per-rank values belong in ``rank_state``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_ft.checkpoint.json_codec import TAG

__all__ = ["coverage_problems"]


def _references(obj: Any, out: set[str]) -> set[str]:
    if isinstance(obj, dict):
        if obj.get(TAG) == "tensor":
            out.add(obj["key"])
        else:
            for value in obj.values():
                _references(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _references(value, out)
    return out


def _itemsize(dtype: str) -> int | None:
    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else None


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    return all(max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True))


def _tensor_problems(key: str, record: dict[str, Any]) -> list[str]:
    shape = list(record.get("global_shape", []))
    itemsize = _itemsize(str(record.get("dtype")))
    problems: list[str] = []
    boxes: list[tuple[list[int], list[int], int]] = []
    for shard in record.get("shards", []):
        offset, extent, rank = list(shard["offset"]), list(shard["shape"]), shard["rank"]
        where = f"tensor {key!r}: the shard written by rank {rank} (offset {offset}, shape {extent})"
        if len(offset) != len(shape) or len(extent) != len(shape):
            problems.append(f"{where} does not have the {len(shape)} dimensions of the tensor's shape {shape}")
            continue
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(offset, extent, shape, strict=True)):
            problems.append(
                f"{where} lies outside the tensor's global shape {shape} (ranks passed tensors of different shapes "
                "under one key of the shared state? per-rank values belong in rank_state)"
            )
            continue
        if itemsize is not None and shard.get("nbytes") != math.prod(extent) * itemsize:
            problems.append(
                f"{where} holds {shard.get('nbytes')} bytes, not the {math.prod(extent) * itemsize} its shape needs"
            )
            continue
        boxes.append((offset, extent, rank))
    # Sweep along the first dimension so that only shards whose first-dimension ranges meet are compared.
    boxes.sort(key=lambda b: b[0][0] if b[0] else 0)
    active: list[tuple[list[int], list[int], int]] = []
    overlapping = False
    for box in boxes:
        start = box[0][0] if box[0] else 0
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > start]
        for other in active:
            if _overlap((box[0], box[1]), (other[0], other[1])) and math.prod(box[1]) and math.prod(other[1]):
                problems.append(
                    f"tensor {key!r}: the shards written by ranks {other[2]} and {box[2]} overlap (offsets "
                    f"{other[0]} and {box[0]}, shapes {other[1]} and {box[1]})"
                )
                overlapping = True
        active.append(box)
    covered = sum(math.prod(b[1]) for b in boxes)
    if not problems and not overlapping and covered != math.prod(shape):
        problems.append(f"tensor {key!r}: the stored shards cover {covered} of its {math.prod(shape)} elements")
    return problems


def coverage_problems(document: dict[str, Any]) -> list[str]:
    """Problems that keep checkpoint metadata ``document`` from loading whole; ``[]`` when every tensor is covered.

    Reads only the document (no shard data). Each problem names the tensor key and the ranks involved.
    """
    tensors: dict[str, Any] = document.get("tensors", {})
    problems: list[str] = []
    for key in sorted(_references(document.get("state"), set()) - set(tensors)):
        problems.append(f"tensor {key!r} of the state is missing from the index")
    rank_states = document.get("rank_states", [])
    world_size = document.get("metadata", {}).get("world_size")
    if isinstance(world_size, int) and len(rank_states) != world_size:
        problems.append(f"the checkpoint holds the rank_state of {len(rank_states)} ranks; {world_size} wrote it")
    for rank, rank_state in enumerate(rank_states):
        for key in sorted(_references(rank_state, set()) - set(tensors)):
            problems.append(f"tensor {key!r} of rank {rank}'s rank_state is missing from the index")
    for key, record in tensors.items():
        problems += _tensor_problems(key, record)
    return problems
