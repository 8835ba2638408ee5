"""One process's part in the replica groups for one fit: torchft's ``Manager`` behind lightning-ft's seam.

The strategy drives it from three hooks (docs/replica-groups.md):

=======================  ===========================================================================================
strategy hook            what happens
=======================  ===========================================================================================
``setup`` (fit)          the Manager starts (group rank 0: its server, heartbeating to the lighthouse), the heal
                         transport listens, the DDP communication hook is registered, the step gate wraps
                         ``lr_scheduler_step``
``batch_to_device``      first micro-batch of an optimizer step (training): ``start_quorum`` (blocks until the
                         lighthouse's quorum; reconfigures the cross-group process group when the membership changed;
                         a joining group receives the live state here, before its forward pass; a healthy group
                         serves it); at a new membership the rest of the epoch is dealt anew and the batch in hand
                         replaced by the new deal's first (:mod:`~lightning_ft.replica.data_deal`)
(backward)               :func:`~lightning_ft.replica.gradient_sync.replica_comm_hook`: average in the group, then
                         across the live groups; a failure is recorded, never raised
``optimizer_step``       :class:`~lightning_ft.replica.step_gate.StepGate`: ``should_commit()`` (the group's vote,
                         then all groups'), the step applied or discarded and uncounted
``teardown``             gate undone, Manager and transport shut down
=======================  ===========================================================================================

What crosses groups: only the gradient all-reduce (the Manager's own process group, gloo), the quorum and the commit
vote (RPCs to the lighthouse and the group's manager server), and a heal's state copy (HTTP). Everything Lightning
and torchmetrics do through the strategy (``sync_dist``, ``reduce_boolean_decision``, barriers, ``ModelCheckpoint``'s
collectives, ``all_gather``) stays inside the group, so none of it can wait on a dead group.

The live groups are logged as ``replica/live_groups`` through the trainer's loggers (TensorBoard, CSV, ...) at each
change and every ``log_every_n_steps``. Events (group rank 0, through the run's event log): ``replica_group {step, replica_id, lighthouse, group_size,
num_groups}`` once, before the first quorum (which group of which job this run is), ``replica_quorum {step, live_groups}`` when the membership
changes, ``replica_joined {replica_id, step}``, ``replica_lost {replica_id, step, stall_s, discarded_steps}`` (written
at the first committed step after the loss, when the stall is known) and, on a joining group, ``healed {replica_id,
source, bytes, seconds, step}``; ``replica_data {step, live_groups, group_index, committed, reason, repeated,
skipped}`` each time the rest of the epoch is dealt anew (:mod:`~lightning_ft.replica.data_deal`).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_ft import _compat
from lightning_ft.replica.data_deal import ReplicaDataDeal
from lightning_ft.replica.gradient_sync import GradientSync
from lightning_ft.replica.heal_state import apply_heal_state, heal_state
from lightning_ft.replica.heal_transport import HealTransport
from lightning_ft.replica.step_gate import StepGate

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.events import EventLog
    from lightning_ft.replica.replica_groups import ResolvedReplicaGroups

__all__ = ["ReplicaSync", "members_by_rank"]

_log = logging.getLogger(__name__)


def members_by_rank(replica_ids: list[str]) -> list[str]:
    """A quorum's bare replica ids (``"<id>"`` of torchft's ``"<id>:<uuid>"``) in the quorum's own order, which is the
    order of the replica ranks (``participating_rank``, ``recover_src_replica_rank``, the data deal's
    ``group_index``). torchft sorts the full strings, so this is not always the order of the bare ids (``"10:..."``
    comes before ``"1:..."``): never sort them before indexing by a rank."""
    return [rid.split(":")[0] for rid in replica_ids]


_STATE_KEY = "lightning"


class ReplicaSync:
    """This process's membership in the replica groups during one fit (see the module docstring).

    Args:
        config: the resolved :class:`~lightning_ft.ReplicaGroups`.
        trainer: the fitting trainer (its state is what a heal sends and receives).
        group_rank: this process's rank in its group; ``group_world_size`` the group's size.
        group: the group's process group (``None``: the default group).
        event_log: returns the run's event log (or None).
        hold_sampler: told the training sampler whose count the data deal keeps (the strategy's data position).

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
    ) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.config = config
        self._trainer = trainer
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._event_log = event_log
        self.transport = HealTransport(address=config.address, timeout=config.timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=config.timeout),
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
            checkpoint_transport=self.transport,
            init_sync=True,  # the first step copies one group's initial state to all: weights agree whatever the seed
        )
        self.manager.register_state_dict_fn(_STATE_KEY, self._load, self._state)
        self._quorum: Any = None
        self._recorder = _compat.quorum_recorder_patch(self.manager, self._record_quorum).install()
        self.gradients = GradientSync(self.manager, group=group, group_size=group_world_size)
        self.gate = StepGate(self._vote)
        self.data = ReplicaDataDeal(
            trainer, group_size=group_world_size, local_rank=group_rank, write=self._write, hold=hold_sampler
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
        try:
            self.manager.start_quorum(timeout=timeout)
        except Exception as e:
            raise RuntimeError(
                f"ReplicaGroups(min_replicas={self.config.min_replicas}): no quorum of replica groups formed within"
                f" {timeout} at step {trainer.global_step} (lighthouse {self.config.lighthouse}): {e}"
            ) from e
        self._quorums += 1
        self._step_open = True
        if first and self.resume_floor is not None and trainer.global_step < self.resume_floor:
            raise RuntimeError(
                f"ReplicaGroups: this group left the checkpoint at step {self.resume_floor} on disk to heal from a live"
                f" group, but the quorum's newest step is {trainer.global_step} (the groups seen live were gone);"
                " stopping rather than rewinding: restart the group, it then resumes from the checkpoint"
            )
        changed = self._after_quorum(trainer.global_step)
        self._log_live_groups(trainer, changed)
        return self.data.after_quorum(
            live_groups=self.manager.num_participants(),
            group_index=self.manager.participating_rank(),
            members=tuple(self._members or ()),
            step=trainer.global_step,
        )

    def _vote(self) -> bool:
        """``should_commit`` for this step (the group's ranks, then every group), with its bookkeeping."""
        committed = bool(self.manager.should_commit())
        self._step_open = False
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
                _log.info("replica groups: %d step(s) discarded, no group lost", self._discarded_since_commit)
            self._lost = []
            self._commit_before_loss = None
            self._discarded_since_commit = 0
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

    # ------------------------------------------------------------------ membership and events

    def _record_quorum(self, result: Any) -> None:  # torchft's quorum thread
        self._quorum = result

    def _after_quorum(self, step: int) -> bool:
        """Record a change of membership (events); returns whether it changed."""
        result = self._quorum
        if result is None:
            return False
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
        from lightning_ft.replica.checkpoint_owner import checkpoint_writer

        return not self._members or checkpoint_writer(self._members) == self.config.replica_id

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
        return heal_state(self._trainer)

    def _load(self, state: dict[str, Any]) -> None:  # the training thread, inside start_quorum, on a joining group
        started = time.monotonic()
        apply_heal_state(self._trainer, state)
        self.data.forget_deal()  # the sampler holds the source's committed count: the quorum deals anew from it
        size, fetch_s = self.transport.last_received or (0, 0.0)
        result = self._quorum
        source = None
        if result is not None and result.recover_src_replica_rank is not None:
            ids = members_by_rank(result.replica_ids)
            if 0 <= result.recover_src_replica_rank < len(ids):
                source = ids[result.recover_src_replica_rank]
        record = {
            "replica_id": self.config.replica_id,
            "source": source,
            "bytes": size,
            "seconds": fetch_s + (time.monotonic() - started),
            "step": self._trainer.global_step,
        }
        self.heals.append(record)
        self._write("healed", **record)

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Leave the quorum: undo the gate and the recorder, shut the manager and the heal server down."""
        self.gate.uninstall()
        self._recorder.undo()
        self.manager.shutdown(wait=False)
