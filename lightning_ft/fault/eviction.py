"""Eviction: a sick node leaves the job through torch.distributed.elastic, and its health record keeps it out.

lightning-ft launches nothing; torchrun's agents own the membership. :func:`evict_node` uses what they already do:

1. every rank saves ``preempt-step=<N>`` (:func:`~lightning_ft.stop.checkpoint_and_stop`), so nothing is retrained;
2. the leaving node writes its :class:`~lightning_ft.fault.health_record.HealthRecord` beside the checkpoints (every
   node reads that folder);
3. the leaving node's workers send SIGTERM to their own torchrun agent (the parent process, verified as the agent
   through the torchrun environment) and wait for the agent's SIGTERM back. An agent that dies of a signal does
   *not* close the rendezvous (``torch/distributed/launcher/api.py``: ``shutdown_rdzv = False`` on
   ``SignalException``), so the job goes on;
4. every other rank exits with the restart code (``FaultPolicy.exit_code``): its agent restarts the worker group and
   joins the next rendezvous round, which forms without the dead agent (its keep-alive expires) and with a spare
   waiting beyond ``--nnodes`` MAX if there is one; the new world resumes from the newest checkpoint with the
   ``ElasticPolicy``'s batch rules.

With replica groups (``ElasticFT3D(replica_groups=...)``, docs/replica-groups-reference.md, "Eviction") the job is one replica
group of several, and nothing restarts: the evicted node's workers write its record, leave through their agent and
exit with :data:`NODE_UNAVAILABLE_EXIT_CODE` without a checkpoint (the live groups hold the state, and a replacement
heals from them); the group leaves the quorum, and to the other groups it is a lost group (``replica_lost``, the step
discarded if it was in flight). A group's other nodes, if it spans several, exit with the restart code and come back
as a joining group that heals. ``--max-restarts=0`` is then allowed (no one needs to restart).

A node that starts while its record says unhealthy and the cooldown has not passed refuses to join
(:func:`refuse_if_unhealthy`, run in the fault handler's pre-flight;
:func:`~lightning_ft.fault.health_record.check_record` for ``lightning-ft health-gate``, which a job script runs before
torchrun). docs/fault-tolerance.md says what torchrun, SLURM and Kubernetes need.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from lightning_ft.checkpoint.internal import is_remote
from lightning_ft.events import get_event_log
from lightning_ft.fault.health_record import (
    NODE_UNAVAILABLE_EXIT_CODE,
    HealthRecord,
    node_name,
    read_record,
    record_path,
    refusal_line,
    write_record,
)
from lightning_ft.stop import EXIT_CODE_TEMPFAIL, NodeStop, checkpoint_and_stop, checkpoint_dir

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

SOURCES = ("straggler", "health_check", "thermal")
"""What asked for an eviction: the ``source`` of ``node_evicted`` and of a health record."""

AGENT_ACK_TIMEOUT_S = 60.0
"""Seconds a leaving worker waits for its agent's SIGTERM (the agent stopping its workers) before it exits anyway."""

_AGENT_COMMANDS = ("torch.distributed.run", "torch.distributed.launch", "torchrun")


def records_dir(trainer: pl.Trainer) -> Path:
    """Where this run keeps its health records: beside the checkpoints (the ``ModelCheckpoint`` ``dirpath``, which
    every node must share), or under ``default_root_dir`` when the checkpoints are in an object store."""
    ckpt = checkpoint_dir(trainer)
    return Path(trainer.default_root_dir) if is_remote(str(ckpt)) else ckpt


# ---------------------------------------------------------------------------------------------------- the agent


def agent_pid() -> int:
    """The pid of this worker's torchrun agent: its parent, verified.

    Raises:
        RuntimeError: not a torchrun worker (no ``TORCHELASTIC_RUN_ID``), or the parent is not a torchrun agent
            (an unknown launcher in between): lightning-ft signals no other process.
    """
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        raise RuntimeError("not started by torchrun (no TORCHELASTIC_RUN_ID): no agent to leave the job through")
    ppid = os.getppid()
    try:
        argv = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
    except OSError as err:
        raise RuntimeError(
            f"cannot read the parent process {ppid} ({err}) to verify it is the torchrun agent"
        ) from None
    words = [a.decode(errors="replace") for a in argv if a]
    if ppid <= 1 or not any(w in _AGENT_COMMANDS or os.path.basename(w) in _AGENT_COMMANDS for w in words):
        raise RuntimeError(
            f"the parent process {ppid} ({' '.join(words)[:200]!r}) is not a torchrun agent; eviction needs the"
            " workers to be torchrun's own children"
        )
    return ppid


def replica_sync(trainer: pl.Trainer | None) -> Any:
    """The fit's replica-group membership (:class:`~lightning_ft.replica.replica_sync.ReplicaSync`: ``replica_id``,
    ``exchange``) when ``trainer`` runs as one replica group of several and the fit has joined; else ``None``."""
    return getattr(trainer.strategy, "_replica", None) if trainer is not None else None


def in_replica_groups(trainer: pl.Trainer | None) -> bool:
    """Whether ``trainer`` runs as one replica group of several (``ElasticFT3D(replica_groups=...)``)."""
    return trainer is not None and getattr(trainer.strategy, "replica_groups", None) is not None


def check_can_evict(owner: str, trainer: pl.Trainer | None = None) -> None:
    """Raise ``ValueError`` naming ``owner`` (``"StragglerMonitor(action='evict')"``) where an eviction could not
    work: not under torchrun, the parent is not the agent, or ``--max-restarts=0`` (the others could not restart).
    With replica groups (``trainer``'s strategy has ``replica_groups``) nobody restarts: ``--max-restarts=0`` is fine."""
    try:
        agent_pid()
    except RuntimeError as err:
        raise ValueError(f"{owner}: {err}; run under torchrun (docs/fault-tolerance.md, 'Eviction')") from None
    if in_replica_groups(trainer):
        return
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        raise ValueError(
            f"{owner}: torchrun runs with --max-restarts=0, so the remaining nodes could not restart without the"
            " evicted one; give it restarts to spare (e.g. --max-restarts=10)"
        )


def leave_through_agent(*, signal_agent: bool, timeout_s: float = AGENT_ACK_TIMEOUT_S) -> None:
    """Make this node's torchrun agent leave the job; return once it stops this worker (or after ``timeout_s``).

    Main thread only. ``signal_agent``: send the agent SIGTERM (one worker per node does; the others only wait). The
    agent answers by sending SIGTERM to its workers, which is caught here, so a worker never exits before its agent
    knows that it is leaving (an early exit would read as a failure, and the agent would restart and rejoin).
    """
    pid = agent_pid()
    received: list[float] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(time.time()))
    try:
        if signal_agent:
            # torchrun prints the SIGTERM as a crash of its own (a traceback ending in SignalException): say first
            # that it is this node leaving on purpose.
            log.warning(
                "lightning-ft: this node leaves the job: its torchrun agent (pid %d) is stopped with SIGTERM; its"
                " 'SignalException: Process %d got signal: 15' traceback below is that, not a failure",
                pid,
                pid,
            )
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not received and time.monotonic() < deadline:
            time.sleep(0.02)
        if not received:
            log.warning("lightning-ft: torchrun agent %d did not stop this worker within %.0f s", pid, timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------------- eviction


def _restart_exit_code(trainer: pl.Trainer) -> int:
    policy = getattr(trainer.strategy, "fault", None)
    return int(getattr(policy, "exit_code", EXIT_CODE_TEMPFAIL))


def _cooldown_s(trainer: pl.Trainer) -> float:
    from lightning_ft.fault.fault_policy import FaultPolicy

    policy = getattr(trainer.strategy, "fault", None)
    return (policy if isinstance(policy, FaultPolicy) else FaultPolicy()).eviction_cooldown_s


def node_ranks(trainer: pl.Trainer, ranks: Iterable[int]) -> list[int]:
    """Every global rank of the nodes that hold ``ranks`` (torchrun numbers a node's ranks contiguously)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or max(trainer.world_size // max(trainer.num_nodes, 1), 1))
    nodes = {r // per_node for r in ranks}
    return [r for r in range(trainer.world_size) if r // per_node in nodes]


def _all_node_names(trainer: pl.Trainer) -> list[str]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, node_name())
        return [str(n) for n in names]
    return [node_name()] * trainer.world_size


def evict_node(
    trainer: pl.Trainer,
    *,
    ranks: Iterable[int],
    source: str,
    reason: str,
    cooldown_s: float | None = None,
    extra: dict[str, Any] | None = None,
) -> NoReturn:
    """Evict the node(s) holding ``ranks``: checkpoint, health record, the node's agent leaves, the others restart.

    Collective: every rank calls it at the same step boundary with the same arguments (monitors decide from the same
    gathered numbers). Blocks until ``preempt-step=<N>`` is committed on every rank, then never returns: a rank of the
    leaving node writes the node's :class:`HealthRecord`, its workers make their torchrun agent leave (see the module
    docstring) and exit with :data:`NODE_UNAVAILABLE_EXIT_CODE`; every other rank exits with the restart code
    (``FaultPolicy.exit_code``, 75), and rank 0 writes ``node_evicted``. Each exit is a
    :class:`~lightning_ft.stop.CheckpointedStop` (``reason="stopped"``), raised from inside ``fit``.

    Args:
        ranks: global ranks of the node(s) to evict; the whole node of each leaves.
        source: ``"straggler"``, ``"health_check"`` or ``"thermal"``.
        reason: one line, the same on every rank.
        cooldown_s: seconds the node refuses to rejoin; ``None``: the strategy's ``FaultPolicy.eviction_cooldown_s``.
        extra: more fields for the record (JSON values).

    Raises:
        ValueError: an unknown ``source``, no rank, a rank outside the world, or a negative ``cooldown_s``.
        RuntimeError: not a torchrun worker whose parent is the agent (see :func:`agent_pid`), before any save.
    """
    wanted = sorted({int(r) for r in ranks})
    if source not in SOURCES:
        raise ValueError(f"evict_node(source={source!r}): must be one of {SOURCES}")
    if not wanted or wanted[0] < 0 or wanted[-1] >= trainer.world_size:
        raise ValueError(f"evict_node(ranks={wanted}): need at least one rank, each in 0..{trainer.world_size - 1}")
    cooldown = _cooldown_s(trainer) if cooldown_s is None else float(cooldown_s)
    if not cooldown >= 0:
        raise ValueError(f"evict_node(cooldown_s={cooldown_s!r}): must be >= 0 seconds")
    if not in_replica_groups(trainer):
        agent_pid()  # before the save: a worker that cannot leave must not start an eviction
    leaving = node_ranks(trainer, wanted)
    rank = trainer.global_rank
    me_leaving = rank in leaving
    hosts = _all_node_names(trainer)  # collective: rank 0 names each leaving node in node_evicted
    folder = records_dir(trainer)
    event_log = get_event_log(trainer, open_if_missing=False)
    step = trainer.global_step
    reason = " ".join(str(reason).split())
    by_host: dict[str, list[int]] = {}
    for r in leaving:
        by_host.setdefault(hosts[r], []).append(r)

    def committed(checkpoint: Path | None, replica_id: str | None = None) -> None:
        now = time.time()
        if me_leaving and trainer.local_rank == 0:
            host = hosts[rank]
            record = HealthRecord(
                host=host,
                healthy=False,
                source=source,
                reason=reason,
                time=now,
                until=now + cooldown,
                ranks=tuple(by_host[host]),
                step=step,
                run_id=event_log.run_id if event_log is not None else None,
                extra=dict(extra or {}),
            )
            write_record(folder, record)
        if trainer.is_global_zero:
            for host, its_ranks in by_host.items():
                path = record_path(folder, host)
                if event_log is not None:
                    event_log.write(
                        "node_evicted",
                        host=host,
                        ranks=its_ranks,
                        source=source,
                        reason=reason,
                        cooldown_s=cooldown,
                        record_path=str(path),
                        checkpoint_path=None if checkpoint is None else str(checkpoint),
                        **({} if replica_id is None else {"replica_id": replica_id}),
                    )
                log.warning(
                    "lightning-ft: evicting node %r (ranks %s; %s: %s); it stays out for %.0f s (%s); %s",
                    host,
                    its_ranks,
                    source,
                    reason,
                    cooldown,
                    path,
                    f"its replica group {replica_id} leaves the quorum"
                    if replica_id is not None
                    else f"the others restart with code {_restart_exit_code(trainer)}",
                )
        if me_leaving:
            try:
                leave_through_agent(signal_agent=trainer.local_rank == 0)
            except RuntimeError as err:  # replica groups outside torchrun: no agent to leave through
                if replica_id is None:
                    raise
                log.info("lightning-ft: %s", err)

    if in_replica_groups(trainer):
        _leave_replica_groups(trainer, by_host=by_host, me_leaving=me_leaving, folder=folder, write_record_fn=committed)
    exit_code = NODE_UNAVAILABLE_EXIT_CODE if me_leaving else _restart_exit_code(trainer)
    checkpoint_and_stop(trainer, exit_code=exit_code, reason="stopped", on_committed=committed)


def _leave_replica_groups(
    trainer: pl.Trainer,
    *,
    by_host: dict[str, list[int]],
    me_leaving: bool,
    folder: Path,
    write_record_fn: Any,
) -> NoReturn:
    """:func:`evict_node` with replica groups: no checkpoint and no restart of the other groups (module docstring).

    The record, the ``node_evicted`` event (with this group's ``replica_id``) and the leave through the agent are
    :func:`evict_node`'s own (``write_record_fn``, called with no checkpoint); the group's ranks then raise
    :class:`NodeStop`, and the strategy's teardown takes the group out of the quorum."""
    replica_id = getattr(replica_sync(trainer), "replica_id", None)
    if replica_id is not None:
        log.warning("lightning-ft: replica group %s leaves the quorum; the other groups go on without it", replica_id)
    write_record_fn(None, replica_id=replica_id)
    hosts = ", ".join(sorted(by_host))
    if me_leaving:
        raise NodeStop(NODE_UNAVAILABLE_EXIT_CODE, detail=f"replica group {replica_id}: node(s) {hosts} evicted")
    raise NodeStop(
        _restart_exit_code(trainer), detail=f"replica group {replica_id}: node(s) {hosts} evicted; this node rejoins"
    )


def refuse_if_unhealthy(trainer: pl.Trainer) -> None:
    """At set-up, before the first step: stop every rank if any node is in its cooldown. Collective.

    Each rank reads its own node's record (no record, a healthy one or a passed cooldown: the node may join) and all
    ranks exchange the answers. If some node refuses, its workers print the one line of :func:`refusal_line`, write
    ``join_refused``, make their agent leave and exit with :data:`NODE_UNAVAILABLE_EXIT_CODE`; the other ranks exit
    with the restart code so that their agents form the world again without it (one more rendezvous round for
    everybody: a job script's ``lightning-ft health-gate`` before torchrun costs nothing).

    Raises:
        NodeStop: on every rank when some node refuses.
    """
    folder = records_dir(trainer)
    host = node_name()
    now = time.time()
    record = read_record(folder, host)
    mine = record if record is not None and record.refuses(now) else None
    answers: list[Any] = [(host, mine is not None)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        answers = [None] * dist.get_world_size()
        dist.all_gather_object(answers, (host, mine is not None))
    refused = sorted({h for h, no in answers if no})
    if not refused:
        return
    event_log = get_event_log(trainer, open_if_missing=False)
    if mine is not None:
        line = refusal_line(mine, record_path(folder, host), now)
        if trainer.local_rank == 0:
            print(line, file=sys.stderr, flush=True)
        if event_log is not None:
            event_log.write(
                "join_refused",
                step=None,
                host=host,
                reason=mine.reason,
                source=mine.source,
                until=mine.until,
                exit_code=NODE_UNAVAILABLE_EXIT_CODE,
                record_path=str(record_path(folder, host)),
            )
        try:
            leave_through_agent(signal_agent=trainer.local_rank == 0)
        except RuntimeError as err:  # not torchrun's own worker: nothing to leave through, the exit code says it all
            log.info("lightning-ft: %s", err)
        raise NodeStop(NODE_UNAVAILABLE_EXIT_CODE, detail=line)
    code = _restart_exit_code(trainer)
    if trainer.is_global_zero:
        log.warning(
            "lightning-ft: node(s) %s refuse to join (health record in its cooldown); exiting with code %d so that"
            " torchrun forms the world without them",
            refused,
            code,
        )
    raise NodeStop(code, detail=f"node(s) {refused} refused to join")
