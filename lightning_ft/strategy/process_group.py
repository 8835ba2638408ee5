"""The training process group, set up so that each torchrun restart talks only to its own peers.

Under torchrun every restart of the worker group talks to the same agent store (torchrun shares its rendezvous
TCPStore with the workers), so the process-group keys of the previous attempt are still there and gloo or NCCL can
read a dead peer's address (pytorch #135712). Keying the group's store by the run id and the restart count isolates
the attempts. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torchrun hands out a fresh store instead, and nothing
needs doing; outside torchrun Lightning's own initialisation runs unchanged.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_ft import _compat


def init_for_this_restart(
    cluster_environment: Any, *, backend: str, global_rank: int, world_size: int, timeout: timedelta
) -> bool:
    """Initialise the default process group on a store prefix of its own for this torchrun restart.

    Collective: every rank of the new worker group calls it. Returns False (and does nothing) outside torchrun's
    shared store, or when a default group already exists; Lightning then initialises the group as usual.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart is None:
        return False
    store = dist.TCPStore(
        cluster_environment.main_address,
        cluster_environment.main_port,
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(f"lightning_ft/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/restart{restart}", store)
    dist.init_process_group(backend, store=prefixed, rank=global_rank, world_size=world_size, timeout=timeout)
    return True


def destroy_at_exit(backend: str) -> None:
    """Destroy the default group at interpreter exit, for every backend.

    Lightning registers this for NCCL only; a gloo group left to interpreter exit can abort a process whose training
    succeeded ("terminate called without an active exception"), which torchrun would read as a failure and restart.
    """
    if backend != "nccl":
        atexit.register(_compat.destroy_dist_connection)
