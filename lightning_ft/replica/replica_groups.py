"""``ReplicaGroups``: the configuration of replica-level fault tolerance (``ElasticFT3D(replica_groups=...)``).

A *replica group* is one torchrun job (a node: one or more processes) that holds a whole copy of the model. Inside a
group everything runs as without this option (DDP over the group's own process group); across groups the gradients
are averaged through torchft's ``Manager``, which a lighthouse server joins into a quorum at every step. When a group
dies or hangs, the others drop it from the average and keep stepping; a group that (re)joins copies the live state
from a healthy one before its first step (docs/replica-groups.md). This module holds the user's choice and the rules
that resolve its values from the environment; :mod:`~lightning_ft.replica.replica_sync` does the work.

The names follow torchft's own launch conventions, so that a torchft launch recipe works unchanged: the lighthouse
address defaults to ``TORCHFT_LIGHTHOUSE``, the group's id to ``REPLICA_GROUP_ID`` and the number of groups to
``NUM_REPLICA_GROUPS`` (what ``torchft.torchx`` sets); ``min_replicas`` is the lighthouse's own name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "LIGHTHOUSE_ENV",
    "NUM_GROUPS_ENV",
    "PROCESS_GROUPS",
    "REPLICA_ID_ENV",
    "ReplicaGroups",
    "ResolvedReplicaGroups",
]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the lighthouse address (``http://host:port``)."""
REPLICA_ID_ENV = "REPLICA_GROUP_ID"
"""torchft's variable for this group's id (``0``, ``1``, ...; what ``torchft.torchx`` sets per group)."""
NUM_GROUPS_ENV = "NUM_REPLICA_GROUPS"
"""torchft's variable for the number of replica groups the data is split over."""

PROCESS_GROUPS = ("gloo", "nccl", "baby_nccl")
"""The process groups ``ReplicaGroups(process_group=...)`` names: torchft's ``ProcessGroupGloo``, ``ProcessGroupNCCL``
and ``ProcessGroupBabyNCCL``."""

_ADDRESS = re.compile(r"^https?://[^\s/:]+(:\d+)?/?$|^https?://\[[0-9a-fA-F:.]+\](:\d+)?/?$")
_REPLICA_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(kw_only=True, frozen=True)
class ReplicaGroups:
    """Keep training when a replica group (a torchrun job, usually a node) dies: the others go on within seconds,
    and a replacement copies the live state from a healthy group.

    Off unless given: ``ElasticFT3D(replica_groups=None)`` (the default) restarts every process at a failure, as
    before. Start one lighthouse for the job (``lightning-ft lighthouse --min-replicas 1``: its defaults cost the
    survivors about a second per lost group; docs/replica-groups.md), then one torchrun per group with
    ``REPLICA_GROUP_ID`` set.

    Example::

        from datetime import timedelta
        from lightning_ft import ElasticFT3D, ReplicaGroups

        strategy = ElasticFT3D(
            replica_groups=ReplicaGroups(lighthouse="http://lighthouse-host:29510", min_replicas=2)
        )

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a malformed address or id, ``min_replicas`` or ``num_groups`` below 1, ``min_replicas`` above
            ``num_groups``, a ``timeout`` or ``lighthouse_wait`` that is not positive, or an unknown
            ``process_group``.
    """

    lighthouse: str | None = None
    """Address of torchft's lighthouse, ``http://host:port``. ``None``: the environment variable
    ``TORCHFT_LIGHTHOUSE`` (as torchft reads it); one of the two must be set when ``fit`` starts."""

    min_replicas: int = 1
    """Groups that must take part in a step for it to be committed. Below it, a step is discarded and the quorum
    waits; when no quorum of this size forms within the quorum timeout (12 x ``timeout``), ``fit`` stops with an
    error (torchrun may then restart the group, which rejoins)."""

    timeout: timedelta = timedelta(seconds=5)
    """The one failure-detection setting. Collectives across groups (the gradient all-reduce), the commit vote and
    the copy of the state to a joining group give up after it (a hung group costs the others this long); the quorum
    waits up to 12 x ``timeout`` (the first quorum of a process up to 10 minutes, while the other groups start);
    the group's manager heartbeats every ``timeout / 20`` (0.1 s to 1 s). A dead group (SIGKILL, node loss) is
    noticed at once by the all-reduce and dropped when the lighthouse misses its heartbeats
    (``--heartbeat_timeout_ms``, which should be at most ``timeout``). Default 5 seconds. torchft's environment
    variables ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC`` and ``TORCHFT_CONNECT_TIMEOUT_SEC`` are ignored
    (with a warning at set-up): this is the one setting."""

    replica_id: str | None = None
    """This group's id, the same on every rank of the group and unique in the job; a replacement for a lost group
    takes the lost group's id. ``None``: the environment variable ``REPLICA_GROUP_ID``. Letters, digits, ``_``, ``.``
    and ``-``; a number (``0``..``num_groups - 1``) also places the group's part of the data."""

    num_groups: int | None = None
    """Number of replica groups the training data is split over (the group with id ``i`` reads part ``i``).
    ``None``: the environment variable ``NUM_REPLICA_GROUPS``, else 1 (every group reads the whole data set, as one
    data-parallel group would)."""

    address: str | None = None
    """Host name or IP this group's manager and its state server advertise to the others, and that the state server
    binds. ``None``: this machine's host name, the server listening on every interface (torchft's behaviour)."""

    process_group: str = "gloo"
    """The process group that joins rank ``r`` of every group (the gradient all-reduce): ``"gloo"`` (torchft's
    ``ProcessGroupGloo``: CPU tensors, or CUDA tensors through host memory), ``"nccl"`` (torchft's
    ``ProcessGroupNCCL``) or ``"baby_nccl"`` (torchft's ``ProcessGroupBabyNCCL``: NCCL in a child process, which a
    failure can end without ending the trainer). The NCCL ones need a CUDA device on every rank, and rank ``r`` of
    each group on a GPU of its own; they are not verified on CPU-only machines (scripts/gpu_check.sh runs them)."""
    lighthouse_wait: timedelta = timedelta(minutes=5)
    """How long the groups wait for a lighthouse that does not answer (killed, its node lost, restarting) before
    they stop. Within it, a lighthouse restarted at the same address costs the time it was down: the groups resume
    at the next quorum. Past it, the group that writes checkpoints commits ``preempt-step=<N>``, and every group
    stops with one message naming the lighthouse (exit code ``FaultPolicy.exit_code``, 75 by default); a relaunch
    resumes from that checkpoint. A starting group waits as long for the lighthouse to answer. Default 5 minutes:
    long enough for a scheduler to restart the lighthouse (docs/replica-groups.md, "When the lighthouse dies")."""

    def __post_init__(self) -> None:
        if self.process_group not in PROCESS_GROUPS:
            raise ValueError(
                f"ReplicaGroups(process_group={self.process_group!r}): must be one of"
                f" {', '.join(repr(n) for n in PROCESS_GROUPS)} (torchft's process group across the groups)"
            )
        if self.lighthouse is not None:
            _check_lighthouse(self.lighthouse, "lighthouse")
        _check_count("min_replicas", self.min_replicas)
        if self.num_groups is not None:
            _check_count("num_groups", self.num_groups)
            if self.min_replicas > self.num_groups:
                raise ValueError(
                    f"ReplicaGroups(min_replicas={self.min_replicas}, num_groups={self.num_groups}): min_replicas"
                    " must be <= num_groups (no quorum could ever form)"
                )
        if not isinstance(self.timeout, timedelta):
            raise TypeError(f"ReplicaGroups(timeout={self.timeout!r}): must be a datetime.timedelta")
        if self.timeout <= timedelta(0):
            raise ValueError(f"ReplicaGroups(timeout={self.timeout!r}): must be positive (e.g. timedelta(seconds=5))")
        if not isinstance(self.lighthouse_wait, timedelta):
            raise TypeError(f"ReplicaGroups(lighthouse_wait={self.lighthouse_wait!r}): must be a datetime.timedelta")
        if self.lighthouse_wait <= timedelta(0):
            raise ValueError(
                f"ReplicaGroups(lighthouse_wait={self.lighthouse_wait!r}): must be positive (e.g. timedelta(minutes=5))"
            )
        if self.replica_id is not None:
            _check_replica_id(self.replica_id, "replica_id")
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ValueError(f"ReplicaGroups(address={self.address!r}): must be a host name or IP address")

    def resolved(self) -> ResolvedReplicaGroups:
        """The values in force, with the environment's defaults filled in; called at set-up on every rank.

        Raises:
            ValueError: no lighthouse address or no replica id (neither given nor in the environment), or a
                malformed value in the environment (the message names the variable).
        """
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None
        if lighthouse is None:
            raise ValueError(
                f"ReplicaGroups(lighthouse=None): no lighthouse address; set ReplicaGroups(lighthouse="
                f"'http://host:port') or the environment variable {LIGHTHOUSE_ENV}"
            )
        _check_lighthouse(lighthouse, "lighthouse" if self.lighthouse else LIGHTHOUSE_ENV)
        replica_id = self.replica_id or os.environ.get(REPLICA_ID_ENV) or None
        if replica_id is None:
            raise ValueError(
                f"ReplicaGroups(replica_id=None): no replica group id; set ReplicaGroups(replica_id=...) or the"
                f" environment variable {REPLICA_ID_ENV} (the same on every rank of a group, unique per group)"
            )
        _check_replica_id(replica_id, "replica_id" if self.replica_id else REPLICA_ID_ENV)
        num_groups = self.num_groups
        known = num_groups is not None or bool(os.environ.get(NUM_GROUPS_ENV))
        if num_groups is None:
            raw = os.environ.get(NUM_GROUPS_ENV)
            try:
                num_groups = int(raw) if raw else 1
            except ValueError:
                raise ValueError(f"{NUM_GROUPS_ENV}={raw!r}: must be a whole number of replica groups") from None
            _check_count(NUM_GROUPS_ENV, num_groups)
        return ResolvedReplicaGroups(
            lighthouse=lighthouse.rstrip("/"),
            min_replicas=self.min_replicas,
            timeout=self.timeout,
            replica_id=replica_id,
            num_groups=num_groups,
            address=self.address,
            num_groups_known=known,
            process_group=self.process_group,
            lighthouse_wait=self.lighthouse_wait,
        )


@dataclass(kw_only=True, frozen=True)
class ResolvedReplicaGroups:
    """:class:`ReplicaGroups` with every default resolved (:meth:`ReplicaGroups.resolved`)."""

    lighthouse: str
    min_replicas: int
    timeout: timedelta
    replica_id: str
    num_groups: int
    address: str | None
    num_groups_known: bool = True
    """Whether ``num_groups`` was given (the field or ``NUM_REPLICA_GROUPS``) rather than the default 1: the
    ``ElasticPolicy`` needs the full membership to scale at a change of the live groups."""
    process_group: str = "gloo"
    """``ReplicaGroups.process_group``."""
    lighthouse_wait: timedelta = timedelta(minutes=5)

    @property
    def quorum_timeout(self) -> timedelta:
        """How long a quorum may take once training runs: 12 x ``timeout``."""
        return self.timeout * 12

    @property
    def first_quorum_timeout(self) -> timedelta:
        """How long the first quorum of a process may take (the other groups may still be starting)."""
        return max(self.quorum_timeout, timedelta(minutes=10))

    @property
    def heartbeat_interval(self) -> timedelta:
        """How often the group's manager heartbeats to the lighthouse: ``timeout / 20``, within 0.1 s to 1 s."""
        return min(max(self.timeout / 20, timedelta(milliseconds=100)), timedelta(seconds=1))

    @property
    def connect_timeout(self) -> timedelta:
        """How long connecting to the lighthouse or another group's manager may take: ``timeout``, at least 10 s."""
        return max(self.timeout, timedelta(seconds=10))

    @property
    def data_part(self) -> int:
        """The part of the data this group reads: its id when that is a number below ``num_groups``, else 0."""
        return int(self.replica_id) % self.num_groups if self.replica_id.isdigit() else 0


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ReplicaGroups({name}={value!r}): must be an int (a number of replica groups)")
    if value < 1:
        raise ValueError(f"ReplicaGroups({name}={value}): must be >= 1 (a number of replica groups)")


def _check_lighthouse(value: object, name: str) -> None:
    if not isinstance(value, str) or not _ADDRESS.match(value.strip()):
        where = f"ReplicaGroups({name}={value!r})" if name == "lighthouse" else f"{name}={value!r}"
        raise ValueError(f"{where}: must be the lighthouse's address as http://host:port")


def _check_replica_id(value: object, name: str) -> None:
    if not isinstance(value, str) or not _REPLICA_ID.match(value):
        where = f"ReplicaGroups({name}={value!r})" if name == "replica_id" else f"{name}={value!r}"
        raise ValueError(f"{where}: must be a non-empty id of letters, digits, '_', '.' or '-', unique per group")
