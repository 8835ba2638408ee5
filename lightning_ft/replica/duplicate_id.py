"""One replica id, one live group: a group never trains beside another process with its ``REPLICA_GROUP_ID``.

torchrun starts its workers in their own session (``start_new_session``), so a SIGKILL of a group's torchrun agent
(or its death by the OOM killer) leaves the workers training, heartbeating to the lighthouse and, for the checkpoint
writer, saving. A replacement launched with the same id would then be a second participant with the same
``REPLICA_GROUP_ID`` (torchft's Manager adds a uuid per process, so the lighthouse takes both), and two groups would
write the job's checkpoints. Three guards, from the cheapest:

- **The orphan stops itself** (:class:`AgentWatch`): a worker of a replica group watches its torchrun agent (its
  parent, verified at set-up); when the agent is gone (the parent pid changed), it stops at once, as it would have had
  it shared the agent's session. Nothing is lost that the other groups do not hold: a save in flight never commits
  (the commit is atomic) and the next quorum's lowest id writes the next one.
- **The newer one refuses at join** (:func:`refuse_a_live_duplicate`): before its manager starts, a group asks the
  lighthouse whether a process with its id still heartbeats. A live one is told from one that just died (a group
  restarted by torchrun, whose last heartbeat is still fresh) by whether its heartbeat is renewed; when it keeps being
  renewed for ``ReplicaGroups.timeout``, the starting group stops with an error that names the id and the other's
  manager address and step. The older process is a healthy group holding the committed state (a mistaken second launch
  with the same id) or an orphan that stops within a second (above): stopping it could kill a healthy survivor, while
  the newer one holds nothing yet.
- **At the quorum** (:func:`duplicates_in_quorum`, the backstop when both started at once): a process in its first
  quorum that finds another participant with its id refuses, with the same error; an older one writes
  ``replica_duplicate`` and trains on, and of the two the one with the lower full id is the only writer of
  checkpoints.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from lightning_ft import _compat

__all__ = ["AgentWatch", "DuplicateReplicaError", "duplicates_in_quorum", "refuse_a_live_duplicate"]

_log = logging.getLogger(__name__)

ORPHAN_EXIT_CODE = 70
"""The exit status of a worker that stopped because its torchrun agent was gone (nobody reads it: the agent is)."""


class DuplicateReplicaError(RuntimeError):
    """Another live process has this group's ``REPLICA_GROUP_ID``."""


def _refusal(replica_id: str, others: list[str], status: _compat.LighthouseStatus | None, where: str) -> str:
    described = []
    for other in others:
        step, manager = status.members.get(other, (None, None)) if status is not None else (None, None)
        age = status.heartbeats.get(other, (None, False))[0] if status is not None else None
        parts = [f"torchft id {other}"]
        if manager:
            parts.append(f"manager {manager}")
        process = _process_of(manager) if manager else None
        if process:
            parts.append(f"pid {process.get('pid')} on host {process.get('host')}")
        if step is not None:
            parts.append(f"at step {step}")
        if age is not None:
            parts.append(f"heartbeat {age:.1f} s ago")
        described.append(", ".join(parts))
    return (
        f"ReplicaGroups: REPLICA_GROUP_ID={replica_id} is taken by a live process ({'; '.join(described)}) {where}:"
        " this group stops rather than train beside it as a second participant with the same id. Either another group"
        " was launched with this id (give each group its own REPLICA_GROUP_ID), or it is a worker of a torchrun that"
        " was killed (torchrun starts its workers in their own session, so they outlive a SIGKILLed agent; lightning-ft"
        " stops such a worker within a second: relaunch this group then)"
    )


def _process_of(manager: str) -> dict[str, object] | None:
    """The pid and host of group rank 0 of the group whose manager server is at ``manager`` (asked through its heal
    server, best effort: ``None`` when either cannot be asked)."""
    from lightning_ft.replica.heal_transport import serving_process

    try:
        metadata = _compat.manager_checkpoint_metadata(manager, rank=0, timeout_s=2)
    except Exception:  # noqa: BLE001 - only a detail of an error message
        return None
    return serving_process(metadata, timeout_s=2)


def refuse_a_live_duplicate(
    lighthouse: str,
    replica_id: str,
    *,
    timeout: timedelta,
    connect_timeout_s: float,
    poll_s: float = 1.2,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Raise :class:`DuplicateReplicaError` when another process with ``replica_id`` heartbeats to the lighthouse and
    goes on doing so for ``timeout``; return when none does, or when the lighthouse cannot be reached (the quorum's
    check remains; the Manager cannot join either). A status page lightning-ft cannot read raises
    :class:`~lightning_ft._compat.LighthouseStatusError` (a torchft other than 0.2.0). Call it before this process's torchft Manager starts (its own heartbeats would count).

    A heartbeat renewed between two reads ``poll_s`` apart (more than a Manager's heartbeat interval: at most 1 s
    under lightning-ft, 0.1 s by torchft's default) is a live process; one that ages by the time between the reads
    is a dead one whose last heartbeat is not yet stale (a group torchrun just restarted). Blocks up to ``timeout``
    plus two reads when a live one is found, ``poll_s`` when only a dead one is, not at all otherwise.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    status = _status(lighthouse, connect_timeout_s)
    while True:
        mine = _same_id(status, replica_id)
        if not mine:
            return
        before, read_at = status, time.monotonic()
        sleep(poll_s)
        status = _status(lighthouse, connect_timeout_s)
        elapsed = time.monotonic() - read_at
        live = [
            name
            for name, (age, old) in _same_id(status, replica_id).items()
            if name in mine and age < mine[name][0] + elapsed - min(0.1, poll_s / 4)
        ]
        live += [name for name in _same_id(status, replica_id) if name not in before.heartbeats]
        if not live:
            return
        if time.monotonic() >= deadline:
            raise DuplicateReplicaError(
                _refusal(
                    replica_id,
                    sorted(live),
                    status,
                    f"at lighthouse {lighthouse}, renewed for {timeout.total_seconds():g} s",
                )
            )


def _status(lighthouse: str, timeout_s: float) -> _compat.LighthouseStatus | None:
    return _compat.lighthouse_status(lighthouse, timeout_s=timeout_s)  # an unreadable page raises (docs)


def _same_id(status: _compat.LighthouseStatus | None, replica_id: str) -> dict[str, tuple[float, bool]]:
    """The fresh heartbeats of processes with ``replica_id`` (``"<id>:<uuid>"``)."""
    if status is None:
        return {}
    return {name: beat for name, beat in status.heartbeats.items() if name.split(":")[0] == replica_id and not beat[1]}


def duplicates_in_quorum(replica_ids: list[str], replica_rank: int, *, first_quorum: bool) -> list[str]:
    """The other participants of a quorum (torchft's full ids ``"<id>:<uuid>"``, this process's at ``replica_rank``)
    that have this process's replica id. Raises :class:`DuplicateReplicaError` when there are some and this is the
    process's first quorum (the newer process refuses); returns them otherwise (an older process trains on)."""
    own = replica_ids[replica_rank]
    bare = own.split(":")[0]
    others = [rid for rid in replica_ids if rid != own and rid.split(":")[0] == bare]
    if others and first_quorum:
        raise DuplicateReplicaError(_refusal(bare, others, None, "in this group's first quorum"))
    return others


class AgentWatch:
    """Stop this worker when its torchrun agent is gone: a daemon thread compares the parent pid with the agent's
    every ``interval``; on a change it prints why to stderr, calls ``on_orphaned`` (an event; errors ignored) and
    exits the process with :data:`ORPHAN_EXIT_CODE` (``os._exit``: no teardown, so no save of a stale writer).

    ``agent_pid``: the agent's pid (its parent's at set-up, verified by
    :func:`~lightning_ft.fault.eviction.agent_pid`). :meth:`stop` ends the thread (teardown).
    """

    def __init__(
        self,
        agent_pid: int,
        replica_id: str,
        *,
        interval: timedelta = timedelta(seconds=0.5),
        on_orphaned: Callable[[int], None] = lambda parent: None,
        exit: Callable[[int], None] = os._exit,  # noqa: A002 - the one call it makes
    ) -> None:
        self.agent_pid = agent_pid
        self._replica_id = replica_id
        self._interval = interval.total_seconds()
        self._on_orphaned = on_orphaned
        self._exit = exit
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-ft-agent-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            parent = os.getppid()
            if parent == self.agent_pid:
                continue
            print(
                f"lightning-ft: this worker's torchrun agent (pid {self.agent_pid}) is gone (the parent is now pid"
                f" {parent}): stopping worker pid {os.getpid()} of replica group REPLICA_GROUP_ID={self._replica_id},"
                " so that a replacement with the same id does not train beside it (torchrun starts its workers in"
                " their own session: they outlive a SIGKILLed agent)",
                file=sys.stderr,
                flush=True,
            )
            try:
                self._on_orphaned(parent)
            except Exception:  # noqa: BLE001 - the exit matters more than the record
                _log.exception("lightning-ft: recording the orphaned worker failed")
            self._exit(ORPHAN_EXIT_CODE)
            return

    def stop(self) -> None:
        self._stopped.set()
