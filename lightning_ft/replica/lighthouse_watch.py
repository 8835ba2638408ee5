"""When the lighthouse dies: the groups wait for it, and stop with a committed checkpoint when it stays away.

torchft's lighthouse is one process per job. Three things keep it from being the job's single point of failure
(docs/replica-groups.md, "When the lighthouse dies"):

- The group's manager server (torchft's Rust ``ManagerServer``) retries a quorum request that fails, with a new
  connection each time (``Manager(quorum_retries=`` :func:`quorum_retries` ``)``, for the request's deadline
  :func:`quorum_request_timeout`). Without retries, a request that meets a dead lighthouse is dropped and never
  answered: the training thread waits out the whole quorum timeout, whether the lighthouse came back or not.
- :class:`LighthouseWatch` replaces the wait of ``Manager.start_quorum``: while a quorum takes longer than usual it
  probes the lighthouse (a heartbeat with this group's id, so that a restarted lighthouse knows every group before
  it forms its first quorum), measures how long it did not answer, and decides when to give up:
  ``ReplicaGroups.lighthouse_wait`` after the lighthouse stopped answering (:class:`LighthouseGone`), or the quorum
  timeout after it last answered (:class:`QuorumTimeout`, the quorum cannot form: too few groups).
- :class:`QuorumIds` gives each quorum an id that stays unique when the lighthouse restarts. A restarted lighthouse
  counts its quorum ids from 1 again; torchft reconfigures the cross-group process group only when the id changes,
  and names its rendezvous keys after it. A repeated id would keep a process group whose members changed, or meet the
  keys of an earlier rendezvous in the same store.

:func:`wait_for_lighthouse` waits as long at set-up, before the Manager connects, so that a group relaunched while the
lighthouse restarts resumes once it is back. :func:`stop_without_lighthouse` is the end of a wait that ran out: the
writing group's checkpoint, one line, the exit code.
"""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from lightning_ft.replica.replica_groups import ResolvedReplicaGroups

__all__ = [
    "LighthouseGone",
    "LighthouseProbe",
    "LighthouseWatch",
    "QuorumIds",
    "QuorumTimeout",
    "QuorumWait",
    "quorum_request_timeout",
    "quorum_retries",
    "stop_without_lighthouse",
    "wait_for_lighthouse",
]

_log = logging.getLogger(__name__)

PROBE_AFTER_S = 0.5
"""A quorum that takes longer than this is probed: a normal one takes milliseconds, one that waits for a dead group's
heartbeat to time out about a second."""
PROBE_EVERY_S = 0.25
"""How often a slow quorum probes the lighthouse."""
PROBE_DOWN_EVERY_S = 0.1
"""How often it probes a lighthouse that does not answer: how soon a restarted one hears this group again."""
PROBE_TIMEOUT_S = 1.0
"""How long one probe may take before it counts as unanswered."""
DOWN_AFTER = 2
"""Unanswered probes in a row before the lighthouse counts as down (one can be lost on a loaded machine)."""


class LighthouseGone(RuntimeError):
    """The lighthouse did not answer for ``ReplicaGroups.lighthouse_wait``.

    Attributes:
        lighthouse: its address.
        waited_s: how long it did not answer, seconds.
    """

    def __init__(self, lighthouse: str, waited_s: float, wait: timedelta) -> None:
        super().__init__(
            f"the lighthouse {lighthouse} did not answer for {waited_s:.0f} s"
            f" (ReplicaGroups(lighthouse_wait={_seconds(wait)}))"
        )
        self.lighthouse = lighthouse
        self.waited_s = waited_s


class QuorumTimeout(TimeoutError):
    """The lighthouse answered, but no quorum formed within the quorum timeout."""


@dataclass(frozen=True)
class QuorumWait:
    """How one quorum went: ``waited_s`` in all, and ``down_s`` of it the lighthouse did not answer (0 without an
    outage); ``down_since`` is the wall time (Unix seconds) of the first unanswered probe, ``None`` without one."""

    waited_s: float
    down_s: float
    down_since: float | None


class LighthouseProbe:
    """Whether the lighthouse answers: a heartbeat with this group's full replica id (``<id>:<uuid>``, once the
    first quorum named it), else a GET of its index page. A heartbeat is what torchft's manager server sends every
    heartbeat interval; sent from here too while a quorum waits, a restarted lighthouse learns of every live group
    within :data:`PROBE_EVERY_S` of its start, before the first group's quorum request can make a quorum without
    the others.

    Not thread-safe: the training thread calls it, inside :meth:`LighthouseWatch.wait`.
    """

    def __init__(
        self, lighthouse: str, full_id: Callable[[], str | None] = lambda: None, timeout_s: float = PROBE_TIMEOUT_S
    ) -> None:
        self.lighthouse = lighthouse.rstrip("/")
        self._full_id = full_id
        self._timeout_s = timeout_s
        self._client: Any = None

    def __call__(self) -> bool:
        full_id = self._full_id()
        if full_id is None:
            return self._index_page()
        if self._client is None and not self._accepts():
            return False  # refused at once: torchft's client would retry its connection for its whole timeout
        try:
            if self._client is None:
                from torchft.coordination import LighthouseClient

                self._client = LighthouseClient(self.lighthouse, connect_timeout=timedelta(seconds=self._timeout_s))
            self._client.heartbeat(full_id, timeout=timedelta(seconds=self._timeout_s))
            return True
        except Exception:  # torchft raises RuntimeError (no connection) or its own status error (timed out)
            self._client = None  # a new connection next time: the old one may be to the dead process
            return False

    def _accepts(self) -> bool:
        host, _, port = urllib.parse.urlsplit(self.lighthouse).netloc.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=self._timeout_s).close()
            return True
        except (OSError, ValueError):
            return False

    def _index_page(self) -> bool:
        try:
            with urllib.request.urlopen(self.lighthouse + "/", timeout=self._timeout_s) as response:
                return 200 <= response.status < 500
        except (OSError, urllib.error.URLError, ValueError):
            return False


class LighthouseWatch:
    """The wait for a quorum, in place of ``Manager.wait_quorum`` (see the module docstring).

    Args:
        lighthouse: the lighthouse's address (for the messages).
        wait: ``ReplicaGroups.lighthouse_wait``.
        probe: returns whether the lighthouse answers (:class:`LighthouseProbe`); called at most every
            :data:`PROBE_EVERY_S` while a quorum takes longer than :data:`PROBE_AFTER_S`.
        clock: monotonic seconds; ``wall``: Unix seconds (tests pass fakes).

    Example::

        watch = LighthouseWatch("http://lighthouse:29510", wait=timedelta(minutes=5), probe=LighthouseProbe(...))
        record = watch.wait(lambda t: future_done_within(t), quorum_timeout_s=60)
    """

    def __init__(
        self,
        lighthouse: str,
        *,
        wait: timedelta,
        probe: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.lighthouse = lighthouse
        self.lighthouse_wait = wait
        self._probe = probe
        self._clock = clock
        self._wall = wall

    def wait(self, done: Callable[[float], bool], *, quorum_timeout_s: float) -> QuorumWait:
        """Block until ``done(seconds)`` (waits up to that long, returns whether the quorum is in) says so.

        Called by the training thread of every rank, inside ``start_quorum``. Blocks; probes only after
        :data:`PROBE_AFTER_S`.

        Raises:
            LighthouseGone: the lighthouse did not answer for ``lighthouse_wait``.
            QuorumTimeout: it answered, but no quorum formed within ``quorum_timeout_s`` of the start or of its
                return.
        """
        start = self._clock()
        counted_from = start  # the quorum timeout runs from the start, or from the lighthouse's return
        next_probe = start + PROBE_AFTER_S
        unanswered: list[tuple[float, float]] = []  # (monotonic, wall) time of each unanswered probe in a row
        down_at: float | None = None  # the first unanswered probe of the outage in progress
        down_s = 0.0
        down_since: float | None = None  # wall time of the first outage's first unanswered probe
        wait_s = self.lighthouse_wait.total_seconds()
        while True:
            if done(max(0.0, min(next_probe - self._clock(), PROBE_EVERY_S))):
                if down_at is not None:  # the quorum came before a probe saw the lighthouse back
                    down_s += self._clock() - down_at
                return QuorumWait(waited_s=self._clock() - start, down_s=down_s, down_since=down_since)
            now = self._clock()
            if now < next_probe:
                continue
            next_probe = now + (PROBE_DOWN_EVERY_S if unanswered else PROBE_EVERY_S)
            wall = self._wall()
            if self._probe():
                unanswered = []
                if down_at is not None:
                    down_s += self._clock() - down_at
                    _log.warning("lightning-ft: the lighthouse %s answers again after %.1f s", self.lighthouse, down_s)
                    down_at, counted_from = None, self._clock()
                elif self._clock() - counted_from > quorum_timeout_s:
                    raise QuorumTimeout(f"the lighthouse answers, but no quorum formed within {quorum_timeout_s:g} s")
                continue
            unanswered.append((now, wall))
            if len(unanswered) == DOWN_AFTER:
                down_at = unanswered[0][0]
                down_since = unanswered[0][1] if down_since is None else down_since
                _log.warning(
                    "lightning-ft: the lighthouse %s does not answer; waiting up to %s for it"
                    " (ReplicaGroups.lighthouse_wait)",
                    self.lighthouse,
                    _seconds(self.lighthouse_wait),
                )
            if down_at is not None and self._clock() - down_at >= wait_s:
                raise LighthouseGone(self.lighthouse, self._clock() - down_at, self.lighthouse_wait)


def wait_for_lighthouse(
    lighthouse: str,
    wait: timedelta,
    *,
    probe: Callable[[], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Block until the lighthouse answers (its index page), at most ``wait``; return the seconds waited.

    Every rank of a starting group calls it before its Manager connects (torchft's own connection gives up after
    ``connect_timeout``, which a restarting lighthouse can outlast). Returns at once when it answers.

    Raises:
        LighthouseGone: it did not answer within ``wait``.
    """
    probe = probe or LighthouseProbe(lighthouse)
    start = clock()
    said = False
    while not probe():
        waited = clock() - start
        if waited >= wait.total_seconds():
            raise LighthouseGone(lighthouse, waited, wait)
        if not said:
            _log.warning(
                "lightning-ft: the lighthouse %s does not answer; waiting up to %s for it"
                " (ReplicaGroups.lighthouse_wait)",
                lighthouse,
                _seconds(wait),
            )
            said = True
        sleep(PROBE_DOWN_EVERY_S)
    return clock() - start


def quorum_retries(config: ResolvedReplicaGroups) -> int:
    """Retries of a failed quorum request to the lighthouse: enough, about one every ``_RETRY_S``, to last as long as
    the training thread waits (torchft's server sleeps the request's timeout / (retries + 1), at least 0.1 s, before
    it connects again); without retries a request that meets a dead lighthouse is never answered."""
    return math.ceil(quorum_request_timeout(config, first=True).total_seconds() / _RETRY_S)


_RETRY_S = 0.25


def quorum_request_timeout(config: ResolvedReplicaGroups, *, first: bool) -> timedelta:
    """The deadline of one quorum request: the quorum timeout plus ``lighthouse_wait`` (the training thread's
    :class:`~lightning_ft.replica.lighthouse_watch.LighthouseWatch` gives up earlier, on whichever applies)."""
    quorum = config.first_quorum_timeout if first else config.quorum_timeout
    return quorum + config.lighthouse_wait + config.connect_timeout


def stop_without_lighthouse(
    trainer: Any,
    gone: LighthouseGone,
    *,
    replica_id: str,
    saves: bool,
    group_rank: int,
    quorum: Any,
    write: Callable[..., None],
) -> NoReturn:
    """The lighthouse stayed away for ``lighthouse_wait``: stop this group. Never returns.

    With ``saves`` (the group that writes checkpoints, once this process took part in a quorum: before, it holds what
    it resumed from), every rank commits ``preempt-step=<N>``, the committed state, first. Then group rank 0 writes
    ``lighthouse_lost`` (``write(event, step=..., **fields)``) and one line, and every rank exits with
    ``FaultPolicy.exit_code`` (75 by default). Every rank of the group calls it from the quorum wait (each gives up on
    its own clock, within a probe of the others). ``quorum`` is the Manager's quorum future: its thread waits on the
    dead lighthouse until the request's deadline, and the process exits without waiting for it.

    Raises:
        CheckpointedStop: on the writing group, once the checkpoint is committed.
        NodeStop: on the others.
    """
    from lightning_ft import _compat
    from lightning_ft.stop import EXIT_CODE_TEMPFAIL, NodeStop, checkpoint_and_stop

    code = int(getattr(getattr(trainer.strategy, "fault", None), "exit_code", EXIT_CODE_TEMPFAIL))
    step = trainer.global_step

    def stopped(path: Any) -> None:
        write(
            "lighthouse_lost",
            step=step,
            lighthouse=gone.lighthouse,
            waited_s=gone.waited_s,
            checkpoint_path=None if path is None else str(path),
        )
        if group_rank == 0:
            _log.warning(
                "lightning-ft: %s; replica group %s stops at step %d%s, exit code %d: relaunch the groups once the"
                " lighthouse is back, they resume from the newest committed checkpoint",
                gone,
                replica_id,
                step,
                f" after saving {path}" if path is not None else " (another group saves the checkpoint)",
                code,
            )

    _compat.exit_before_joining_threads(code, when=lambda: quorum is not None and not quorum.done())
    if saves:
        checkpoint_and_stop(trainer, exit_code=code, reason="stopped", on_committed=stopped)
    stopped(None)
    raise NodeStop(code, detail=f"replica group {replica_id}: {gone}")


class QuorumIds:
    """Quorum ids that stay unique across restarts of the lighthouse, the same in every group of a quorum.

    torchft's ``Manager`` reconfigures the cross-group process group when a quorum's id differs from the last one,
    under the store prefix ``torchft/<id>/<group rank>``. The lighthouse counts ids from 1 at its start and raises
    them at each change of membership; a restarted one counts from 1 again, so an id can repeat with other members
    (a process group left as it was, or kept when it must change) or meet an earlier rendezvous's keys.

    :meth:`assign` replaces the lighthouse's id in each quorum result, before torchft reads it, by a hash of what
    every member of the quorum sees alike: the lighthouse's id, the members' full replica ids (``<id>:<uuid>``, one
    per process) and the quorum's step. A new id is drawn only when the lighthouse's id or the members change, so a
    quorum like the last one keeps the id (and the process group) of the last one.

    Called from the Manager's quorum thread (the quorum recorder, :func:`~lightning_ft._compat.quorum_recorder_patch`).
    """

    def __init__(self) -> None:
        self._key: tuple[int, tuple[str, ...]] | None = None
        self._id = -1

    def assign(self, result: Any) -> int:
        """Set ``result.quorum_id`` (a torchft ``QuorumResult``) to this quorum's id; return it."""
        key = (int(result.quorum_id), tuple(str(r) for r in result.replica_ids))
        if key != self._key:
            self._key = key
            self._id = quorum_id(key[0], key[1], int(result.max_step))
        result.quorum_id = self._id
        return self._id


def quorum_id(lighthouse_id: int, replica_ids: tuple[str, ...], max_step: int) -> int:
    """A positive 62-bit id for a quorum: a hash of the lighthouse's id, the members' full ids and the step."""
    text = f"{lighthouse_id}|{max_step}|" + ",".join(replica_ids)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


def _seconds(value: timedelta) -> str:
    seconds = value.total_seconds()
    return f"timedelta(seconds={seconds:g})" if seconds < 120 else f"timedelta(minutes={seconds / 60:g})"
