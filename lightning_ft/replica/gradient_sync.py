"""The DDP communication hook that averages gradients inside a replica group and then across the live groups.

torchft's own ``torchft.ddp.DistributedDataParallel`` hook ends with ``assert fut._fut``: when a peer group dies
inside the all-reduce, the failed work's ``wait()`` returns False before the future chain is built, and the assertion
kills the *surviving* process (measured with torchft 0.2.0; tests/replica/test_gradient_sync.py keeps a case that
shows it). This hook instead waits for the cross-group work itself and always returns a completed future with the
bucket: on a failure the manager has recorded the error, ``should_commit()`` returns False on every group, and the
step is discarded rather than applied; the bucket's contents are then garbage, which no one reads.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects (``dist.GradBucket``).
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradientSync", "replica_comm_hook"]


class GradientSync:
    """The state of :func:`replica_comm_hook`: the torchft manager (across groups) and the group's process group.

    Args:
        manager: the torchft ``Manager`` of this process.
        group: the process group of this replica group (``None``: the default group); ``group_size`` its size.
    """

    def __init__(self, manager: Any, *, group: Any = None, group_size: int = 1) -> None:
        self.manager = manager
        self.group = group
        self.group_size = group_size


def replica_comm_hook(state: "GradientSync", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one gradient bucket over the group (as DDP's default hook: divide, then sum) and then over the live
    replica groups (torchft's ``Manager.allreduce``, an average over the quorum's participants).

    Called by DDP on every rank of every group, once per bucket, during backward; blocks until both reductions end.
    Never raises for a failure across groups: it is reported to the manager, which discards the step.
    """
    buffer = bucket.buffer()
    if state.group_size > 1:
        buffer.div_(state.group_size)
        dist.all_reduce(buffer, group=state.group)
    # wait() returns False (and the manager records the error) when a peer group failed; a manager that already
    # failed in this step returns a finished dummy work, so the remaining buckets cost nothing.
    state.manager.allreduce(buffer).wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
