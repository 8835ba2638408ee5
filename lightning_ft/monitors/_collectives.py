"""The small collectives the monitors use, on the default process group, and no-ops without one.

Each is collective: every rank must call it at the same point, with rows of the same length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


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


def start_gather_rows(row: list[float], device: torch.device) -> PendingRows:
    """Start gathering every rank's ``row`` without blocking; collective, all ranks must call in the same order.

    The collective runs in the background and is queued on the default group before whatever collective the
    training step issues next (DDP's gradient all-reduce), so ranks that arrive early do not stand still for it.
    """
    if not distributed():
        return PendingRows([list(row)])
    local = torch.tensor(row, dtype=torch.float64, device=_tensor_device(device))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    work = dist.all_gather(gathered, local, async_op=True)
    return PendingRows(None, work, gathered)
