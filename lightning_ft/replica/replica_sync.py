"""One process's part in the replica groups for one fit: torchft's ``Manager`` behind lightning-ft's seam.

The strategy drives it from three hooks (docs/replica-groups.md):

=======================  ===========================================================================================
strategy hook            what happens
=======================  ===========================================================================================
``setup`` (fit)          the Manager starts (group rank 0: its server, heartbeating to the lighthouse; torchft's
                         timeout variables ignored, with a warning), the heal transport listens, the torchrun agent is
                         watched (:class:`~lightning_ft.replica.duplicate_id.AgentWatch`), ``ModelCheckpoint``'s name
                         check is answered from a :class:`~lightning_ft.replica.checkpoint_owner.WriterView`, the DDP
                         communication hook is registered, the step gate wraps ``lr_scheduler_step``
``batch_to_device``      first micro-batch of an optimizer step (training): ``start_quorum`` (blocks until the
                         lighthouse's quorum, waiting out a lighthouse that does not answer for up to
                         ``lighthouse_wait``, then stopping: :mod:`~lightning_ft.replica.lighthouse_watch`; reconfigures the cross-group process group when the membership changed;
                         a joining group receives the live state here, before its forward pass; a healthy group
                         serves it); at a new membership the ``ElasticPolicy`` sets the accumulation and the
                         learning-rate factor (:mod:`~lightning_ft.elastic.replica_policy`), then the rest of the
                         epoch is dealt anew and the batch in hand replaced by the new deal's first
                         (:mod:`~lightning_ft.replica.data_deal`); another
                         participant with this group's id refuses this one in its first quorum; a non-writing group
                         lists the checkpoint folders (what the writer sees when it names the step's saves)
(backward)               :func:`~lightning_ft.replica.gradient_sync.replica_comm_hook`: average in the group, then
                         across the live groups; a failure is recorded, never raised. A sharded model (FSDP2, tensor
                         parallel): :class:`~lightning_ft.replica.sharded_sync.ShardedSync` averages each rank's
                         shards with the same rank of the others after the step's last backward, and heals per rank
``optimizer_step``       :class:`~lightning_ft.replica.step_gate.StepGate`: ``should_commit()`` (the group's vote,
                         then all groups'), the step applied or discarded and uncounted
(batch and epoch end)    :class:`~lightning_ft.replica.one_model.OneModel`: the groups agree on ``trainer.should_stop``
                         and compare a fingerprint of the state (a group that differs heals at the next quorum); at
                         a new quorum, before a received state is loaded, they compare their configuration
``teardown``             agent watch stopped, name check and gate undone, Manager and transport shut down
=======================  ===========================================================================================

What crosses groups: only the gradient all-reduce (the Manager's own process group, gloo), the quorum and the commit
vote (RPCs to the lighthouse and the group's manager server), and a heal's state copy (HTTP). Everything Lightning
and torchmetrics do through the strategy (``sync_dist``, ``reduce_boolean_decision``, barriers, ``ModelCheckpoint``'s
collectives, ``all_gather``) stays inside the group, so none of it can wait on a dead group.

On the console (group rank 0), a lost group is one line on each survivor, naming it, the step and the failed
all-reduce, with the ``ElasticPolicy``'s change (torchft's own INFO lines and tracebacks are off unless asked for:
:mod:`~lightning_ft.replica.torchft_console`); a group that takes over writing checkpoints from a writer lost mid-save
removes the save it left unfinished, or names it (:mod:`~lightning_ft.replica.lost_writer`).

The live groups are logged as ``replica/live_groups`` through the trainer's loggers (TensorBoard, CSV, ...) at each
change and every ``log_every_n_steps``. Events (group rank 0, through the run's event log): ``replica_group {step, replica_id, lighthouse, group_size,
num_groups}`` once, before the first quorum (which group of which job this run is), ``replica_quorum {step, live_groups}`` when the membership
changes, ``replica_joined {replica_id, step}``, ``replica_lost {replica_id, step, stall_s, discarded_steps}`` (written
at the first committed step after the loss, when the stall is known) and, on a joining group, ``healed {replica_id,
source, bytes, seconds, step}``; ``replica_data {step, live_groups, group_index, committed, reason, repeated,
skipped}`` each time the rest of the epoch is dealt anew (:mod:`~lightning_ft.replica.data_deal`);
``replica_policy {step, live_groups, accumulate_grad_batches, global_batch, lr_scale, ...}`` each time the
``ElasticPolicy`` was applied to a new number of live groups (lightning_ft/elastic/replica_policy.py);
``lighthouse_outage {step, lighthouse, down_s, stall_s, down_since}`` after a quorum that waited for the lighthouse,
and ``lighthouse_lost {step, lighthouse, waited_s, checkpoint_path}`` before a stop when it stayed away.

Why one module: it is the one object that drives torchft's ``Manager`` through a fit, in the order the hooks above
call it; each concern it composes already lives in a module of its own (the lighthouse watch, the one-model checks,
the sharded path, the data deal, the step gate, the heal transport and state). Split further, the order of a quorum,
a heal, the checks and the vote would be spread over several files that each need the others' state.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning_ft import _compat
from lightning_ft.replica.checkpoint_owner import WriterView, checkpoint_writer, writing_process
from lightning_ft.replica.data_deal import ReplicaDataDeal
from lightning_ft.replica.duplicate_id import AgentWatch, duplicates_in_quorum
from lightning_ft.replica.gradient_sync import GradientSync
from lightning_ft.replica.heal_state import apply_heal_state, heal_state
from lightning_ft.replica.heal_transport import HealTransport
from lightning_ft.replica.lighthouse_watch import (
    LighthouseGone,
    LighthouseProbe,
    LighthouseWatch,
    QuorumIds,
    QuorumWait,
    quorum_request_timeout,
    quorum_retries,
    stop_without_lighthouse,
    wait_for_lighthouse,
)
from lightning_ft.replica.lost_writer import settle_lost_writer
from lightning_ft.replica.one_model import OneModel
from lightning_ft.replica.step_gate import StepGate
from lightning_ft.replica.torchft_console import TorchftConsole

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from torchft import Manager

    from lightning_ft.events import EventLog
    from lightning_ft.replica.replica_groups import ResolvedReplicaGroups
    from lightning_ft.replica.sharded_sync import ShardedSync

__all__ = ["ReplicaSync", "members_by_rank", "replica_manager"]

_log = logging.getLogger(__name__)


def members_by_rank(replica_ids: list[str]) -> list[str]:
    """A quorum's bare replica ids (``"<id>"`` of torchft's ``"<id>:<uuid>"``) in the quorum's own order, which is the
    order of the replica ranks (``participating_rank``, ``recover_src_replica_rank``, the data deal's
    ``group_index``). torchft sorts the full strings, so this is not always the order of the bare ids (``"10:..."``
    comes before ``"1:..."``): never sort them before indexing by a rank."""
    return [rid.split(":")[0] for rid in replica_ids]


_STATE_KEY = "lightning"


def replica_manager(
    config: ResolvedReplicaGroups, *, group_rank: int, group_world_size: int, transport: HealTransport
) -> Manager:
    """This process's torchft ``Manager``, its timeouts all from ``ReplicaGroups.timeout``; its server retries a
    failed quorum request to the lighthouse until the training thread gives up (replica/lighthouse_watch.py). Waits
    first, up to ``ReplicaGroups.lighthouse_wait``, for the lighthouse to answer.

    torchft's own environment variables for its timeouts (``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC``,
    ``TORCHFT_CONNECT_TIMEOUT_SEC``) would win over what is passed to the Manager, but only for some of its waits
    (not the process group's, the heal server's or the heartbeat's), in whole seconds: ``ReplicaGroups.timeout`` is
    the one setting, so they are ignored here, and group rank 0 warns, naming each variable and what is in force.
    Collective over the group (every rank builds its Manager; rank 0 starts the manager server).
    """
    from torchft import Manager
    from torchft.manager import CONNECT_TIMEOUT_SEC_ENV, QUORUM_RETRIES_ENV, QUORUM_TIMEOUT_SEC_ENV, TIMEOUT_SEC_ENV

    names = (TIMEOUT_SEC_ENV, QUORUM_TIMEOUT_SEC_ENV, CONNECT_TIMEOUT_SEC_ENV, QUORUM_RETRIES_ENV)
    ignored = {name: os.environ[name] for name in names if name in os.environ}
    if ignored and group_rank == 0:
        warnings.warn(
            f"lightning-ft: {', '.join(f'{k}={v}' for k, v in ignored.items())} ignored: ReplicaGroups(timeout="
            f"{config.timeout!r}) sets torchft's timeouts (collectives, the commit vote and the heal"
            f" {config.timeout.total_seconds():g} s, the quorum {config.quorum_timeout.total_seconds():g} s,"
            f" connections {config.connect_timeout.total_seconds():g} s) and ReplicaGroups(lighthouse_wait="
            f"{config.lighthouse_wait!r}) how long a quorum request to the lighthouse is retried: change"
            " ReplicaGroups(...) instead, or unset the variable",
            UserWarning,
            stacklevel=2,
        )
    wait_for_lighthouse(config.lighthouse, config.lighthouse_wait)
    with _environment_without(ignored):
        return Manager(
            pg=cross_group_process_group(config),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,  # a joining group loads the state before its forward pass
            timeout=config.timeout,
            quorum_timeout=config.quorum_timeout,
            connect_timeout=config.connect_timeout,
            rank=group_rank,
            world_size=group_world_size,
            lighthouse_addr=config.lighthouse,
            replica_id=config.replica_id,
            hostname=config.address or socket.gethostname(),
            heartbeat_interval=config.heartbeat_interval,
            checkpoint_transport=transport,
            quorum_retries=quorum_retries(config),
            init_sync=True,  # the first step copies one group's initial state to all: weights agree whatever the seed
        )


def cross_group_process_group(config: ResolvedReplicaGroups) -> Any:
    """torchft's process group that ``ReplicaGroups.process_group`` names, its timeout ``ReplicaGroups.timeout``."""
    import torchft

    names = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL", "baby_nccl": "ProcessGroupBabyNCCL"}
    return getattr(torchft, names[config.process_group])(timeout=config.timeout)


@contextmanager
def _environment_without(names: dict[str, str]) -> Iterator[None]:
    """The process environment without ``names`` (torchft's Manager reads them in its constructor only)."""
    for name in names:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.update(names)


class ReplicaSync:
    """This process's membership in the replica groups during one fit (see the module docstring).

    Args:
        config: the resolved :class:`~lightning_ft.ReplicaGroups`.
        trainer: the fitting trainer (its state is what a heal sends and receives).
        group_rank: this process's rank in its group; ``group_world_size`` the group's size.
        group: the group's process group (``None``: the default group).
        event_log: returns the run's event log (or None).
        hold_sampler: told the training sampler whose count the data deal keeps (the strategy's data position).
        membership: applies the ``ElasticPolicy`` to the live groups of a quorum (``(live_groups, step, cause)``; sets
            the accumulation and the learning-rate factor; ``cause``, a lost group, ends its console line), returning
            the ``replica_policy`` event's fields when it changed something (and then said so in one line; the
            strategy's elastic resume, lightning_ft/elastic/replica_policy.py).
        policy_state: what a joining group copies of it; ``load_policy_state`` puts that in place after a heal.
        on_heal: called with the healed step once a heal's state is in place (the memory tier drops its copies of the
            state the heal replaced).
        checkpoint_folders: the ``ModelCheckpoint`` folders (local ones are listed at each quorum while this group does
            not write: :class:`~lightning_ft.replica.checkpoint_owner.WriterView`).
        agent_pid: this worker's torchrun agent: when it is gone, the worker stops (an
            :class:`~lightning_ft.replica.duplicate_id.AgentWatch`); ``None``: not a torchrun worker, nothing watched.
        data_parallel: ``(size, rank)`` of the group's data-parallel axis and this process's place in it (tensor
            parallel ranks read the same data); ``None``: every process of the group is a data-parallel rank.

    Collective over the group: every rank of the group builds one at set-up (rank 0 starts the manager server, the
    others connect to it through the group's TCPStore at ``MASTER_ADDR:MASTER_PORT``).
    """

    def __init__(
        self,
        config: ResolvedReplicaGroups,
        trainer: pl.Trainer,
        *,
        group_rank: int,
        group_world_size: int,
        group: Any = None,
        event_log: Callable[[], EventLog | None] = lambda: None,
        hold_sampler: Callable[[Any], None] = lambda sampler: None,
        membership: Callable[[int, int, str | None], dict[str, Any] | None] = lambda live_groups, step, cause: None,
        policy_state: Callable[[], dict[str, Any] | None] = lambda: None,
        load_policy_state: Callable[[dict[str, Any]], None] = lambda state: None,
        on_heal: Callable[[int], None] = lambda step: None,
        agent_pid: int | None = None,
        checkpoint_folders: Callable[[], list[Any]] = list,
        data_parallel: tuple[int, int] | None = None,
    ) -> None:
        OneModel.check_trainer(trainer)  # before anything starts
        self.config = config
        self._trainer = trainer
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._event_log = event_log
        self._on_heal = on_heal
        self.console = TorchftConsole().install()
        """torchft's console output for this fit (replica/torchft_console.py); holds the last failed collective."""
        self._failure: str | None = None  # the failed collective of the steps discarded since the last commit
        self.transport = HealTransport(address=config.address, timeout=config.timeout)
        self.manager = replica_manager(
            config, group_rank=group_rank, group_world_size=group_world_size, transport=self.transport
        )
        self.manager.register_state_dict_fn(_STATE_KEY, self._load, self._state)
        self._quorum: Any = None
        self._quorum_ids = QuorumIds()  # ids that stay unique when the lighthouse restarts (lighthouse_watch.py)
        self._recorder = _compat.quorum_recorder_patch(self.manager, self._record_quorum).install()
        self._watch = LighthouseWatch(
            config.lighthouse,
            wait=config.lighthouse_wait,
            probe=LighthouseProbe(config.lighthouse, full_id=lambda: self._own_full_id),
        )
        self._quorum_timeout_s = config.first_quorum_timeout.total_seconds()
        self._last_wait: QuorumWait | None = None
        self._waiter = _compat.quorum_wait_patch(self.manager, self._wait_quorum).install()
        self.gradients = GradientSync(self.manager, group=group, group_size=group_world_size)
        self.sharded: ShardedSync | None = None
        """A sharded model's per-rank gradient average and heal (set by the strategy for FSDP2 or tensor parallel)."""
        self.gate = StepGate(self._vote)
        self._membership = membership
        self._policy_state = policy_state
        self._load_policy_state = load_policy_state
        dp_size, dp_rank = data_parallel or (group_world_size, group_rank)
        self.data = ReplicaDataDeal(
            trainer, group_size=dp_size, local_rank=dp_rank, write=self._write, hold=hold_sampler
        )
        self._step_open = False
        self._quorums = 0
        self._members: list[str] | None = None
        self._lost: list[tuple[str, int]] = []  # (replica id, step) lost and not yet reported
        self._last_commit: float | None = None
        self._commit_before_loss: float | None = None
        self._discarded_since_commit = 0
        self._intervals: deque[float] = deque(maxlen=50)
        self._started = time.monotonic()
        self.heals: list[dict[str, Any]] = []
        """One record per heal of this group: source, bytes, seconds, step."""
        self.resume_floor: int | None = None
        """The step of the checkpoint this group left on disk to heal from a live group instead: its first quorum
        must reach it (replica/checkpoint_owner.py)."""
        self._checkpoint_folders = checkpoint_folders
        self.names = WriterView()
        """The checkpoint folders as the writer sees them, for ``ModelCheckpoint``'s names on a non-writing group."""
        self.names.install(trainer.checkpoint_callbacks)
        self._duplicates: list[str] = []  # other live processes with this group's id (replica/duplicate_id.py)
        self._own_full_id: str | None = None
        self._full_ids: list[str] = []
        self._agent_watch = (
            AgentWatch(agent_pid, config.replica_id, on_orphaned=self._orphaned) if agent_pid is not None else None
        )
        self._pending_heal: dict[str, Any] | None = None  # received in the quorum, loaded once the groups agree
        self.one_model = OneModel(
            trainer,
            exchange=self.exchange,
            manager=self.manager,
            replica_id=config.replica_id,
            group_size=group_world_size,
            write=self._write,
            elastic=getattr(trainer.strategy, "elastic", None),
        )
        """The configuration and state compared across groups, decisions agreed (replica/one_model.py)."""

    # ------------------------------------------------------------------ the step

    def start_step(self) -> bool:
        """Join the quorum for the next optimizer step (first micro-batch of it; later micro-batches do nothing).

        Every rank of the group calls it from the strategy's ``on_train_batch_start``; blocks until the quorum forms
        and, on a joining group, until the live state is loaded.

        Returns whether the rest of the epoch was dealt anew (a new membership, a heal): the batch in hand then
        belongs to the old deal, and the caller replaces it with :meth:`ReplicaDataDeal.refetch`.

        Raises:
            RuntimeError: no quorum of ``min_replicas`` groups formed within the quorum timeout.
        """
        if self._step_open:
            return False
        trainer = self._trainer
        # The batch in hand was counted before the quorum (a heal, a deal): Lightning zeroes the gradients at a step's
        # first micro-batch only when that count is a multiple of the accumulation, which a new one need not keep.
        batch_idx = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        first = self._quorums == 0
        if first and self.manager.current_step() != trainer.global_step:
            # A fit resumed from a checkpoint: the quorum's step is Lightning's committed step count.
            self.manager.load_state_dict(
                {"step": trainer.global_step, "batches_committed": self.manager.batches_committed()}
            )
        if first:  # which group of which job this run is: the whole-job report joins the groups' logs by it
            self._write(
                "replica_group",
                step=trainer.global_step,
                replica_id=self.config.replica_id,
                lighthouse=self.config.lighthouse,
                group_size=self._group_world_size,
                num_groups=self.config.num_groups,
            )
        self.gate.begin_step()
        timeout = self.config.first_quorum_timeout if first else self.config.quorum_timeout
        self._quorum_timeout_s, self._last_wait = timeout.total_seconds(), None
        try:
            self.manager.start_quorum(timeout=quorum_request_timeout(self.config, first=first))
        except LighthouseGone as gone:  # the writer commits preempt-step=<N>, every group stops
            stop_without_lighthouse(
                trainer,
                gone,
                replica_id=self.replica_id,
                saves=self._quorums > 0 and self.writes_checkpoints,
                group_rank=self._group_rank,
                quorum=_compat.quorum_future(self.manager),
                write=self._write,
            )
        except Exception as e:
            raise RuntimeError(
                f"ReplicaGroups(min_replicas={self.config.min_replicas}): no quorum of replica groups formed within"
                f" {timeout} at step {trainer.global_step} (lighthouse {self.config.lighthouse}): {e}"
            ) from e
        self._quorums += 1
        self._step_open = True
        if self._last_wait is not None and self._last_wait.down_s > 0:  # replica/lighthouse_watch.py
            self._write(
                "lighthouse_outage",
                step=trainer.global_step,
                lighthouse=self.config.lighthouse,
                down_s=self._last_wait.down_s,
                stall_s=self._last_wait.waited_s,
                down_since=self._last_wait.down_since,
            )
        self._settle_quorum(trainer)
        if first and self.resume_floor is not None and trainer.global_step < self.resume_floor:
            raise RuntimeError(
                f"ReplicaGroups: this group left the checkpoint at step {self.resume_floor} on disk to heal from a live"
                f" group, but the quorum's newest step is {trainer.global_step} (the groups seen live were gone);"
                " stopping rather than rewinding: restart the group, it then resumes from the checkpoint"
            )
        writer = checkpoint_writer(self._members or ())
        changed = self._after_quorum(trainer.global_step)
        if changed and writer is not None and self._group_rank == 0 and self.writes_checkpoints:
            if writer in {rid for rid, at in self._lost if at == trainer.global_step}:  # lost mid-save, maybe
                settle_lost_writer(self._checkpoint_folders(), lost_writer=writer)
        if self.writes_checkpoints:
            self.names.clear()
        else:  # no group has started a save of this step yet: the folders as the writer will see them
            self.names.refresh(self._checkpoint_folders())
        self._log_live_groups(trainer, changed)
        live = self.manager.num_participants()
        cause = self._loss_cause(trainer.global_step) if changed else None
        # The policy first: the deal reads the accumulation it sets, and sizes the epoch so that its first batch
        # starts a step of that accumulation.
        policy = self._membership(live, trainer.global_step, cause) if live >= 1 else None
        if policy is not None:
            self._write("replica_policy", step=trainer.global_step, **policy)
        elif cause is not None:  # the policy said nothing (unchanged, or none): the loss in a line of its own
            _log.warning("lightning-ft: %s; %d of %d replica group(s) live", cause, live, self.config.num_groups)
        dealt = self.data.after_quorum(
            live_groups=live,
            group_index=self.manager.participating_rank(),
            members=tuple(self._members or ()),
            step=trainer.global_step,
        )
        if batch_idx % max(1, int(trainer.accumulate_grad_batches)):
            self._zero_grad(trainer, batch_idx)
        return dealt

    def _settle_quorum(self, trainer: pl.Trainer) -> None:
        """The configurations compared at a new quorum, then the state a heal received loaded, unless this group or
        its source was refused (replica/one_model.py)."""
        pending, self._pending_heal = self._pending_heal, None
        result = self._quorum
        load = self.one_model.after_quorum(
            quorum_id=getattr(result, "quorum_id", None),
            step=trainer.global_step,
            heal_source=self._heal_source(result) if pending is not None else None,
            source_configuration=pending.get("one_model") if pending is not None else None,
        )
        if pending is not None and load:
            self._apply_heal(pending)

    @staticmethod
    def _zero_grad(trainer: pl.Trainer, batch_idx: int) -> None:
        """What Lightning does at a step's first micro-batch (the LightningModule's ``optimizer_zero_grad``), for a
        step whose first micro-batch Lightning takes for a later one: the previous step's gradients must not add up."""
        module = trainer.lightning_module
        for optimizer in trainer.optimizers:
            module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)

    def _vote(self) -> bool:
        """``should_commit`` for this step (the group's ranks, then every group), with its bookkeeping."""
        self.one_model.voted()
        committed = bool(self.manager.should_commit())
        self._step_open = False
        self._failure = self.console.take_failure() or self._failure
        self.data.after_vote(committed, step=self._trainer.global_step)
        now = time.monotonic()
        if not committed:
            self._discarded_since_commit += 1
            if self._commit_before_loss is None:
                self._commit_before_loss = self._last_commit
            self._stop_below_min_replicas(now)
            return False
        if self._lost or self._commit_before_loss is not None:
            since = self._commit_before_loss if self._commit_before_loss is not None else self._last_commit
            usual = statistics.median(self._intervals) if self._intervals else 0.0
            stall = max(0.0, now - since - usual) if since is not None else 0.0
            for replica_id, step in self._lost:
                self._write(
                    "replica_lost",
                    replica_id=replica_id,
                    step=step,
                    stall_s=stall,
                    discarded_steps=self._discarded_since_commit,
                )
            if not self._lost and self._discarded_since_commit:
                _log.warning(
                    "lightning-ft: %d step(s) discarded before step %d (%s); no replica group was lost",
                    self._discarded_since_commit,
                    self._trainer.global_step,
                    f"the all-reduce across groups failed: {self._failure}" if self._failure else "a group's vote",
                )
            self._lost = []
            self._commit_before_loss = None
            self._discarded_since_commit = 0
            self._failure = None
        elif self._last_commit is not None:
            self._intervals.append(now - self._last_commit)
        self._last_commit = now
        return True

    def _stop_below_min_replicas(self, now: float) -> None:
        """Raise when fewer than ``min_replicas`` groups have been live, with no step committed, for the quorum
        timeout: the run cannot go on until groups come back, and waiting longer hides the failure."""
        if self.live_groups >= self.config.min_replicas:
            return
        since = self._last_commit if self._last_commit is not None else self._started
        if now - since > self.config.quorum_timeout.total_seconds():
            raise RuntimeError(
                f"ReplicaGroups(min_replicas={self.config.min_replicas}): only {self.live_groups} replica group(s) live"
                f" and no step committed for {now - since:.0f} s (the quorum timeout, 12 x timeout={self.config.timeout})"
                f" at step {self._trainer.global_step}; stopping this group"
            )

    def _wait_quorum(self, done: Callable[[float], bool]) -> None:  # in place of Manager.wait_quorum
        self._last_wait = self._watch.wait(done, quorum_timeout_s=self._quorum_timeout_s)

    # ------------------------------------------------------------------ membership and events

    def _record_quorum(self, result: Any) -> None:  # torchft's quorum thread
        self._quorum_ids.assign(result)
        self._quorum = result

    def _after_quorum(self, step: int) -> bool:
        """Record a change of membership (events); returns whether it changed."""
        result = self._quorum
        if result is None:
            return False
        self._check_duplicates(result)
        members = sorted(rid.split(":")[0] for rid in result.replica_ids)
        if members == self._members:
            return False
        previous, self._members = self._members, members
        self._write("replica_quorum", step=step, live_groups=len(members))
        if previous is None:
            return True
        for replica_id in sorted(set(previous) - set(members)):
            self._lost.append((replica_id, step))
            if self._commit_before_loss is None:
                self._commit_before_loss = self._last_commit
        for replica_id in sorted(set(members) - set(previous)):
            self._write("replica_joined", replica_id=replica_id, step=step)
        return True

    def _loss_cause(self, step: int) -> str | None:
        """The console's words for the groups this quorum lost (``None``: none): which, at which step, and what the
        survivors saw (the failed all-reduce, in a few words, with the steps it discarded)."""
        lost = [replica_id for replica_id, at in self._lost if at == step]
        if not lost:
            return None
        which = f"replica group {lost[0]}" if len(lost) == 1 else f"replica groups {', '.join(lost)}"
        if self._failure:
            seen = f"the all-reduce across groups failed: {self._failure}"
        else:
            seen = "it left the quorum"
        discarded = self._discarded_since_commit
        if discarded:
            seen += f"; {discarded} step{'s' if discarded > 1 else ''} discarded"
        return f"{which} lost at step {step} ({seen})"

    def _check_duplicates(self, result: Any) -> None:
        """Refuse (first quorum) or record another participant with this group's id (replica/duplicate_id.py)."""
        self._full_ids = list(result.replica_ids)
        self._own_full_id = result.replica_ids[result.replica_rank]
        others = duplicates_in_quorum(list(result.replica_ids), result.replica_rank, first_quorum=self._quorums == 1)
        if others and others != self._duplicates:
            _log.warning(
                "lightning-ft: another process with REPLICA_GROUP_ID=%s joined the quorum (%s); it is told to stop;"
                " this group trains on",
                self.config.replica_id,
                ", ".join(others),
            )
            self._write("replica_duplicate", step=self._trainer.global_step, replica_id=self.replica_id, others=others)
        self._duplicates = others

    def _orphaned(self, parent: int) -> None:  # the agent watch's thread, just before the process exits
        self._write("replica_orphaned", step=self._trainer.global_step, replica_id=self.replica_id, parent_pid=parent)

    def _log_live_groups(self, trainer: pl.Trainer, changed: bool) -> None:
        """``replica/live_groups`` through the trainer's loggers (global rank 0 of each group), at each change and
        every ``log_every_n_steps``, on Lightning's own step axis (the logging step)."""
        if trainer.global_rank != 0 or not trainer.loggers:
            return
        step = _compat.fit_loop_batches_that_stepped(trainer)
        if changed or step % max(1, trainer.log_every_n_steps) == 0:
            for logger in trainer.loggers:
                logger.log_metrics({"replica/live_groups": float(self.live_groups)}, step=step)

    def _write(self, event: str, *, step: int, **fields: Any) -> None:
        log = self._event_log()
        if log is not None and self._group_rank == 0:
            log.write(event, step=step, **fields)

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints: the live group with the lowest replica id in the last
        quorum (:func:`~lightning_ft.replica.checkpoint_owner.checkpoint_writer`; every group agrees). Before the
        first quorum every group writes its own (nothing is agreed yet)."""
        if not self._members:
            return True
        if self._own_full_id is None:
            return checkpoint_writer(self._members) == self.config.replica_id
        # By full id: should another process with this id be in the quorum (replica/duplicate_id.py), one writes.
        return writing_process(self._full_ids) == self._own_full_id

    @property
    def live_groups(self) -> int:
        """Groups in the current quorum (0 before the first)."""
        return len(self._members or [])

    # ------------------------------------------------------------------ across groups, for the monitors

    def exchange(self, row: list[float]) -> tuple[list[str], int, list[list[float]]] | None:
        """Every live group's ``row`` for this step, through the Manager's all-reduce (a sum in which each group fills
        only its own slot: an all-gather over the quorum's participants).

        Collective across the groups and inside the step: every rank of every live group calls it at the same
        optimizer step, after the quorum and before the vote (``on_before_optimizer_step``), with rows of one length;
        rank ``r`` of each group exchanges with rank ``r`` of the others. Returns ``(member ids, this group's slot,
        rows by slot)``, the ids in the quorum's order (sorted), or ``None`` when this group takes no part in the step
        or a group failed during it (the manager then discards the step, as for the gradients).
        """
        import torch
        from torch.distributed import ReduceOp

        slot = self.manager.participating_rank()
        if slot is None or self.manager.errored() is not None:
            return None
        n = self.manager.num_participants()
        table = torch.zeros(n, len(row), dtype=torch.float64)
        table[slot] = torch.tensor(row, dtype=torch.float64)
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        members = members_by_rank(self._quorum.replica_ids) if self._quorum is not None else []
        if self.manager.errored() is not None or len(members) != n or members[slot] != self.replica_id:
            return None
        return members, slot, table.tolist()

    @property
    def replica_id(self) -> str:
        """This group's id (``ReplicaGroups.replica_id``)."""
        return str(self.config.replica_id)

    # ------------------------------------------------------------------ heal

    def _state(self) -> dict[str, Any]:  # torchft's quorum thread, on a group that serves a joining one
        state = heal_state(self._trainer) if self.sharded is None else self.sharded.heal_state(self._trainer)
        return {
            **state,
            "elastic": self._policy_state(),
            "one_model": self.one_model.configuration(),  # built at this group's first quorum
        }

    def _load(self, state: dict[str, Any]) -> None:  # the training thread, inside start_quorum, on a joining group
        self._pending_heal = state  # loaded after the configurations are compared (_settle_quorum)

    @staticmethod
    def _heal_source(result: Any) -> str | None:
        if result is None or result.recover_src_replica_rank is None:
            return None
        ids = members_by_rank(result.replica_ids)
        return ids[result.recover_src_replica_rank] if 0 <= result.recover_src_replica_rank < len(ids) else None

    def _apply_heal(self, state: dict[str, Any]) -> None:
        started = time.monotonic()
        apply_heal_state(
            self._trainer, state, load_in_place=self.sharded.load_heal_state if self.sharded is not None else None
        )
        if state.get("elastic") is not None:  # the source's rates and accumulation, bitwise (its optimizers are here)
            self._load_policy_state(state["elastic"])
        self.data.forget_deal()  # the sampler holds the source's committed count: the quorum deals anew from it
        size, fetch_s = self.transport.last_received or (0, 0.0)
        record = {
            "replica_id": self.config.replica_id,
            "source": self._heal_source(self._quorum),
            "bytes": size,
            "seconds": fetch_s + (time.monotonic() - started),
            "step": self._trainer.global_step,
        }
        self.heals.append(record)
        self.one_model.healed()
        self._on_heal(self._trainer.global_step)
        self._write("healed", **record)

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Leave the quorum: undo the gate and the recorder, shut the manager and the heal server down.

        Raises:
            RuntimeError: this group's state differed from the live groups' and the fit ended before it healed.
        """
        try:
            self.one_model.leave()  # the exchanges still due, so that no other group waits for this one
            if self._agent_watch is not None:
                self._agent_watch.stop()
            self.names.uninstall()
            self.gate.uninstall()
            self._waiter.undo()
            self._recorder.undo()
            self.manager.shutdown(wait=False)
        finally:
            self.one_model.close()
            self.console.uninstall()
