"""Raise on every rank if one failed: the exchange that ends each collective step of a save or a load.

A step that can fail on some ranks only (an I/O error, a corrupt shard, a template that does not match) must neither
leave the other ranks waiting in the next collective nor let them commit or use what one rank could not write or read.
The writer (:class:`~lightning_ft.checkpoint.AsyncCheckpointer`) ends each of its steps with :func:`agree`, and so does
:func:`~lightning_ft.checkpoint.load_checkpoint`: every rank contributes its error, or none, and a payload; if any
rank failed, every rank raises, otherwise every rank gets every rank's payload.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_ft.checkpoint import errors
from lightning_ft.checkpoint.errors import CheckpointError

__all__ = ["agree", "is_distributed"]


def is_distributed() -> bool:
    """Whether torch.distributed is initialized, so that checkpoint steps are collective."""
    return dist.is_available() and dist.is_initialized()


def agree(
    error: BaseException | None,
    payload: Any = None,
    *,
    group: dist.ProcessGroup | None,
    what: str,
    error_type: type[CheckpointError] = CheckpointError,
    keep_type: bool = False,
) -> list[Any]:
    """Exchange ``(error, payload)`` with every rank of ``group``; raise on every rank if any rank failed.

    Collective over ``group`` when torch.distributed is initialized: every rank calls it, whether it failed or not.
    Without torch.distributed, raises ``error`` or returns ``[payload]``. ``payload`` must be picklable.

    Returns:
        Every rank's ``payload``, in the group's rank order.

    Raises:
        BaseException: ``error`` itself, on the rank that passed it (its own error wins over other ranks' messages).
        CheckpointError: ``error_type(f"{what} failed on rank {r}: ...")`` on every other rank, naming the lowest
            failing rank ``r`` of ``group`` and its error's type and message. With ``keep_type``, a failing rank's
            own ``CheckpointError`` subclass (``CorruptCheckpointError``, say) is raised instead of ``error_type``,
            so that every rank raises the same type.

    Example::

        payloads = agree(None, records, group=group, what="checkpoint save")
    """
    if not is_distributed():
        if error is not None:
            raise error
        return [payload]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    kind = None if error is None else type(error).__name__
    message = None if error is None else f"{kind}: {error}"
    dist.all_gather_object(gathered, (message, payload, kind), group=group)
    if error is not None:
        raise error
    for rank, (message, _, kind) in enumerate(gathered):
        if message is not None:
            raise _error_type(kind, error_type, keep_type)(f"{what} failed on rank {rank}: {message}")
    return [p for _, p, _ in gathered]


def _error_type(kind: str | None, default: type[CheckpointError], keep_type: bool) -> type[CheckpointError]:
    """The failing rank's ``CheckpointError`` subclass named ``kind`` when ``keep_type``, else ``default``."""
    own = getattr(errors, kind, None) if keep_type and kind else None
    return own if isinstance(own, type) and issubclass(own, default) else default
