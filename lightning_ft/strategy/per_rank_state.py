"""State that looks replicated but differs between ranks: BatchNorm statistics, metric buffers, tensors a hook adds.

Under data parallelism the checkpoint writes each replicated tensor once, from whichever rank owns it. Parameters and
optimizer state are identical on every rank by construction; buffers and other tensors need not be (each rank's
BatchNorm sees its own batches). Lightning treats rank 0's values as the truth. At every save, the ranks compare a
fingerprint of each such tensor (one small ``all_gather_object``); for those that differ, the shared state gets rank
0's value and every rank also keeps its own in its rank state, which a resume on the same world size puts back, so
every rank continues bitwise where it stopped.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft import _compat

_KEY = "per_rank_tensors"


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``obj`` with the value at ``path`` replaced; containers on the path are copied, never changed in place."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, head: _set(obj[head], rest, value)}
    items = list(obj)
    items[head] = _set(items[head], rest, value)
    return type(obj)(items) if isinstance(obj, tuple) else items


def _fingerprint(tensor: torch.Tensor) -> tuple[str, list[int], int]:
    data = tensor.detach().contiguous().cpu()
    return (str(data.dtype), list(data.shape), zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()))


def separate(state: dict[str, Any], rank_state: dict[str, Any], *, parameter_names: set[str]) -> dict[str, Any]:
    """Find the tensors of ``state`` that differ between ranks; return ``state`` with rank 0's values for them and
    add this rank's own to ``rank_state``.

    Collective over the default group: every rank calls it, with the same structure. Model parameters
    (``state["state_dict"][name]`` for ``name`` in ``parameter_names``), optimizer state and DTensors are skipped:
    they are identical by construction or sharded. Without a multi-rank default group it returns ``state`` as is.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return state
    candidates = {
        path: tensor
        for path, tensor in _walk(state)
        if path[:1] != ("optimizer_states",)
        and not (path[:1] == ("state_dict",) and len(path) == 2 and path[1] in parameter_names)
        and not isinstance(tensor, _compat.DTensor)
        and not tensor.is_sparse
    }
    if not candidates:
        return state
    mine = [_fingerprint(t) for t in candidates.values()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = [p for i, p in enumerate(candidates) if any(g[i] != mine[i] for g in gathered)]
    if not differing:
        return state
    rank_state[_KEY] = [[list(p), candidates[p]] for p in differing]
    truth = [candidates[p].detach().cpu() if dist.get_rank() == 0 else None for p in differing]
    dist.broadcast_object_list(truth, src=0)
    for path, value in zip(differing, truth, strict=True):
        state = _set(state, path, value.to(candidates[path].device))
    return state


def restore_own(checkpoint: dict[str, Any], rank_state: dict[str, Any], *, same_world: bool) -> dict[str, Any]:
    """Put this rank's own values of the tensors :func:`separate` found back into ``checkpoint`` (a resume on the
    same world size); on another world size every rank keeps rank 0's."""
    if not same_world:
        return checkpoint
    for path, value in rank_state.get(_KEY, []):
        checkpoint = _set(checkpoint, tuple(path), value)
    return checkpoint
