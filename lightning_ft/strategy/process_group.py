"""The training process group, set up so that each torchrun restart talks only to its own peers.

Under torchrun every restart of the worker group can talk to the same agent store (torchrun shares its rendezvous
TCPStore with the workers, ``TORCHELASTIC_USE_AGENT_STORE=True``), so the process-group keys of the previous attempt
are still there and gloo or NCCL can read a dead peer's address (pytorch #135712). The group therefore lives under a
store prefix of its own per worker group. The prefix cannot come from ``TORCHELASTIC_RESTART_COUNT``: that count is
kept per node, so a node that joins a running job starts at 0 while the others are at ``k``, and a healthy node that
restarts its workers because another node is waiting does not count a restart at all. Instead the ranks agree on a
*generation* through the store (:func:`agree_on_generation`): rank 0 draws the next number, and every other rank
learns it through a handshake keyed by a fresh nonce of its own, so no rank can read a previous attempt's answer.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the launch recipe for elastic membership changes, docs/elastic.md)
torchrun hands out a fresh store per rendezvous round and none of this is needed; outside torchrun Lightning's own
initialisation runs unchanged.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_ft import _compat

_POLL_S = 0.01


def init_for_this_restart(
    cluster_environment: Any, *, backend: str, global_rank: int, world_size: int, timeout: timedelta
) -> bool:
    """Initialise the default process group on a store prefix of its own for this torchrun worker group.

    Collective: every rank of the new worker group calls it. Returns False (and does nothing) outside torchrun's
    shared store, or when a default group already exists; Lightning then initialises the group as usual.

    Raises:
        TimeoutError: the ranks did not all arrive within ``timeout``.
    """
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    store = dist.TCPStore(
        cluster_environment.main_address,
        cluster_environment.main_port,
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    prefix = agree_on_generation(store, run_id=run_id, rank=global_rank, world_size=world_size, timeout=timeout)
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=global_rank, world_size=world_size, timeout=timeout
    )
    return True


def agree_on_generation(store: Any, *, run_id: str, rank: int, world_size: int, timeout: timedelta) -> str:
    """The store prefix every rank of this worker group uses, distinct from every earlier group's.

    Collective over the ranks of one worker group, through ``store`` (no process group exists yet); every rank calls
    it once, at start-up. Rank 0 draws a new generation number (``store.add``); each other rank writes a fresh nonce
    under its rank and waits for rank 0's answer under that nonce, so an answer meant for a previous attempt's process
    is never read. Rank 0 answers whatever nonce it finds (a stale one costs one unused key) until all ``world_size -
    1`` others confirm under the new prefix. Blocks until then.

    Raises:
        TimeoutError: not every rank arrived within ``timeout`` (rank 0), or no answer came (other ranks).
    """
    base = f"lightning_ft/{run_id}"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{base}/join/{rank}", nonce)
        answer = f"{base}/answer/{rank}/{nonce}"
        try:
            store.wait([answer], timeout)
        except RuntimeError as err:  # the store's own timeout
            raise TimeoutError(f"rank {rank}: rank 0 did not answer within {timeout} ({err})") from err
        prefix = store.get(answer).decode()
        store.add(f"{prefix}/arrived", 1)
        return prefix
    prefix = f"{base}/generation{store.add(f'{base}/generation', 1)}"
    answered: dict[int, str] = {}
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{prefix}/arrived", 0) < world_size - 1:
        for other in range(1, world_size):
            key = f"{base}/join/{other}"
            if store.check([key]):
                nonce = store.get(key).decode()
                if answered.get(other) != nonce:
                    store.set(f"{base}/answer/{other}/{nonce}", prefix)
                    answered[other] = nonce
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world_size) if r not in answered]
            raise TimeoutError(
                f"rank 0: not every rank of this worker group arrived within {timeout}"
                + (f" (never seen: ranks {missing})" if missing else "")
            )
        time.sleep(_POLL_S)
    return prefix


def elastic_num_nodes(configured: int) -> int:
    """The number of nodes of this torchrun worker group, where the Trainer's ``num_nodes`` cannot know it.

    With ``--nnodes=MIN:MAX`` the number of nodes changes from one rendezvous round to the next, while the Trainer's
    ``num_nodes`` is fixed in the script, and Lightning refuses to start when ``devices x num_nodes`` is not the
    world size. Under torchrun (``TORCHELASTIC_RUN_ID`` set) the group's own count, ``WORLD_SIZE /
    LOCAL_WORLD_SIZE``, is used instead; elsewhere ``configured`` is returned unchanged.
    """
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not world or not local:
        return configured
    world_size, local_size = int(world), int(local)
    if local_size < 1 or world_size % local_size:
        return configured
    return world_size // local_size


def destroy_at_exit(backend: str) -> None:
    """Destroy the default group at interpreter exit, for every backend.

    Lightning registers this for NCCL only; a gloo group left to interpreter exit can abort a process whose training
    succeeded ("terminate called without an active exception"), which torchrun would read as a failure and restart.
    """
    if backend != "nccl":
        atexit.register(_compat.destroy_dist_connection)
