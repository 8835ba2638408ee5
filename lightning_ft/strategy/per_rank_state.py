"""State that looks replicated but differs between ranks: BatchNorm statistics, metric buffers, tensors a hook adds.

Under data parallelism the checkpoint writes each replicated tensor once, from whichever rank owns it. Parameters and
optimizer state are identical on every rank by construction; buffers and other tensors need not be (each rank's
BatchNorm sees its own batches). Lightning treats rank 0's values as the truth: Lightning's checkpoint dict holds them.
At every save, the ranks compare a fingerprint of each such tensor (one small ``all_gather_object``); for those that
differ, the shared state gets rank 0's value, and every rank keeps, in its rank state, the fingerprint of the value
written to the shared state and, on the other ranks, how its own replica differs from it: the rows (along the first
dimension) that differ, or the whole tensor where that is smaller.

A resume on the same world size puts each rank's own replica back where the shared state still holds what was
written (the fingerprint matches), so every rank continues bitwise where it stopped. Where the user edited the
tensor in the file (``torch.load``, change, ``torch.save``), the edit wins on every rank, as under ``DDPStrategy``, where
every rank loads the one dict; rank 0 says so once. Rank 0 keeps no copy: its replica is the shared state's.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat

_KEY = "per_rank_differences"
"""The rank state's key for this release's entries (one dict per tensor, see :func:`separate`)."""
_LEGACY_KEY = "per_rank_tensors"
"""Written by 0.2.0 and earlier: ``[path, whole tensor]`` pairs on every rank, rank 0 included, applied as they are."""


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path``, or ``None`` when the path is not there any more (an edit removed it)."""
    for key in path:
        if isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif isinstance(obj, (list, tuple)) and isinstance(key, int) and 0 <= key < len(obj):
            obj = obj[key]
        else:
            return None
    return obj


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``obj`` with the value at ``path`` replaced; containers on the path are copied, never changed in place, and keep
    their type and attributes (a module's ``state_dict`` is an ``OrderedDict`` whose ``_metadata`` holds the module
    versions its load reads)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out = dict(obj) if type(obj) is dict else copy.copy(obj)
        out[head] = _set(obj[head], rest, value)
        return out
    items = list(obj)
    items[head] = _set(items[head], rest, value)
    return type(obj)(items) if isinstance(obj, tuple) else items


def _fingerprint(tensor: torch.Tensor) -> tuple[str, list[int], int]:
    data = tensor.detach().contiguous().cpu()
    return (str(data.dtype), list(data.shape), zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()))


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, one row per index of its first dimension (CPU, contiguous)."""
    data = tensor.detach().contiguous().cpu()
    return data.reshape(-1).view(torch.uint8).reshape(data.shape[0], -1)


def _difference(own: torch.Tensor, written: torch.Tensor) -> dict[str, Any]:
    """How ``own`` differs from ``written`` (same dtype and shape), in the smaller form: the rows that differ, bitwise,
    or the whole tensor."""
    if own.dim() >= 1 and own.shape[0] > 1 and own.numel():
        changed = (_rows(own) != _rows(written)).any(dim=1).nonzero().reshape(-1)
        row_bytes = own.numel() // own.shape[0] * own.element_size()
        if changed.numel() * (row_bytes + changed.element_size()) < own.numel() * own.element_size():
            return {"rows": changed, "values": own.detach().index_select(0, changed.to(own.device))}
    return {"rows": None, "values": own}


def separate(state: dict[str, Any], rank_state: dict[str, Any], *, parameter_names: set[str]) -> dict[str, Any]:
    """Find the tensors of ``state`` that differ between ranks; return ``state`` with rank 0's values for them and
    add, on every other rank, how its own differ to ``rank_state``.

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
    differing = [i for i, _ in enumerate(candidates) if any(g[i] != mine[i] for g in gathered)]
    if not differing:
        return state
    paths = list(candidates)
    truth = [candidates[paths[i]].detach().cpu() if dist.get_rank() == 0 else None for i in differing]
    dist.broadcast_object_list(truth, src=0)
    entries = []
    for i, value in zip(differing, truth, strict=True):
        path, own = paths[i], candidates[paths[i]]
        written = {"path": list(path), "written": list(gathered[0][i])}
        if dist.get_rank() == 0:
            entries.append(written)  # no values: rank 0's replica is the shared state's; the fingerprint shows edits
        elif gathered[0][i] != mine[i]:
            # A replica of another dtype or shape than rank 0's is kept whole.
            same_layout = own.dtype == value.dtype and own.shape == value.shape
            entries.append({**written, **(_difference(own, value) if same_layout else {"rows": None, "values": own})})
        state = _set(state, path, value.to(own.device))
    if entries:
        rank_state[_KEY] = entries
    return state


_said: set[str] = set()


def restore_own(checkpoint: dict[str, Any], rank_state: dict[str, Any], *, same_world: bool) -> dict[str, Any]:
    """Put this rank's own values of the tensors :func:`separate` found back into ``checkpoint`` (a resume on the
    same world size), where ``checkpoint`` still holds the value written at the save; a tensor the user changed in the
    file keeps the change on every rank (said once). On another world size every rank keeps rank 0's."""
    if not same_world:
        return checkpoint
    for path, value in rank_state.get(_LEGACY_KEY, []):
        checkpoint = _set(checkpoint, tuple(path), value)
    edited = []
    for entry in rank_state.get(_KEY, []):
        path = tuple(entry["path"])
        current = _get(checkpoint, path)
        if not isinstance(current, torch.Tensor) or list(_fingerprint(current)) != list(entry["written"]):
            edited.append(".".join(map(str, path)))
            continue
        values, rows = entry.get("values"), entry.get("rows")
        if values is None:
            continue  # rank 0: the shared state is its own replica
        if rows is None:
            own = values.to(current.device)
        else:
            own = current.detach().clone()
            own[rows.to(current.device)] = values.to(current.device)
        checkpoint = _set(checkpoint, path, own)
    if edited and ",".join(edited) not in _said:
        _said.add(",".join(edited))
        rank_zero_warn(
            f"lightning-ft: {', '.join(edited)} changed in the checkpoint after it was saved: every rank loads the"
            " changed value, as under DDPStrategy, instead of its own replica of the save (so BatchNorm statistics"
            " and other per-rank buffers are not resumed per rank)"
        )
    return checkpoint
