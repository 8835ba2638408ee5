"""The small collectives the monitors use, and no-ops without a process group.

Each is collective: every rank must call it at the same point, with rows of the same length.

The per-window gathers run on a gloo group the monitors share (:func:`acquire_group` at ``setup``,
:func:`release_group` at ``teardown``), not on the default group: there they would queue in front of the next
gradient all-reduce and delay every rank's step by their own latency; on a group of their own they run beside it, on
CPU tensors (no device synchronisation under NCCL). Without that group (a monitor used outside ``fit``) they fall back
to the default group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_group: Any = None
_users = 0
_last_work: Any = None


def distributed() -> bool:
    """Whether a default process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _tensor_device(device: torch.device) -> torch.device:
    # NCCL only moves CUDA tensors; any other backend takes CPU tensors.
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    if not distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_tensor_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class PendingRows:
    """Rows of an ``all_gather`` started with :func:`start_gather_rows`; :meth:`wait` returns them in rank order."""

    def __init__(self, rows: list[list[float]] | None, work: Any = None, tensors: list[torch.Tensor] | None = None):
        self._rows = rows
        self._work = work
        self._tensors = tensors

    def wait(self) -> list[list[float]]:
        if self._rows is None:
            assert self._work is not None and self._tensors is not None
            self._work.wait()
            self._rows = torch.stack(self._tensors).cpu().tolist()
        return self._rows


def acquire_group() -> None:
    """Join the monitors' gather group; the first monitor creates it. Collective: every rank calls it at the same
    point (a callback's ``setup``), so every rank creates the group at the same call."""
    global _group, _users
    if not distributed():
        return
    if _users == 0:
        _group = dist.new_group(backend="gloo")
    _users += 1


def release_group() -> None:
    """Leave the monitors' gather group; the last monitor destroys it, unless a gather on it is still in flight (a run
    that failed between two windows), which would make the destruction wait for peers that may be gone."""
    global _group, _users, _last_work
    if _users == 0:
        return
    _users -= 1
    if _users or _group is None:
        return
    group, work, _group, _last_work = _group, _last_work, None, None
    if work is not None and not work.is_completed():
        log.debug("lightning-ft monitors: a gather is still in flight; its group is left to the process's exit")
        return
    if dist.is_initialized():
        dist.destroy_process_group(group)


def start_gather_rows(row: list[float], device: torch.device) -> PendingRows:
    """Start gathering every rank's ``row`` without blocking; collective, all ranks must call in the same order.

    The collective runs in the background on the monitors' gloo group (the default group when no monitor acquired
    one), so no rank stands still for it and the training step's own collectives do not wait behind it.
    """
    global _last_work
    if not distributed():
        return PendingRows([list(row)])
    on_own_group = _group is not None
    local = torch.tensor(
        row, dtype=torch.float64, device=torch.device("cpu") if on_own_group else _tensor_device(device)
    )
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    work = dist.all_gather(gathered, local, group=_group, async_op=True)
    if on_own_group:
        _last_work = work
    return PendingRows(None, work, gathered)
