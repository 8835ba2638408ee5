"""Elastic resume inside the strategy: the policy's decision, the learning-rate scale, and the ``resumed`` record.

``ElasticFT3D`` inserts one :class:`ElasticResume` into ``trainer.callbacks``. The strategy tells it what it loaded
(:meth:`ElasticResume.checkpoint_loaded`, from ``load_checkpoint``); at ``on_train_start``, once the training
DataLoader exists, it decides from the declared :class:`~lightning_ft.elastic.ElasticPolicy`, the checkpoint's
metadata and the new Trainer's settings (per-device batch, ``accumulate_grad_batches``) what the run trains with:
gradient accumulation and learning-rate scale. A resume the policy cannot serve fails there, before any step. The
learning-rate scale is applied in the optimizers themselves
(:class:`~lightning_ft.elastic.ScaledLearningRates`); its whole state goes into every checkpoint's metadata.

Rank 0 writes the ``resumed`` event once the first step after the resume is done (or when the attempt ends before
it), with the decision and the time the world change cost, in parts (:mod:`lightning_ft.elastic.resume_timing`).
The strategy's ``attempt_end`` (every rank, at teardown) carries :meth:`ElasticResume.last_step`: the time of the
last completed step, which the next attempt's timing starts from.

The one console line rank 0 prints when a checkpoint is loaded is written here too (:func:`resume_message`, and
:func:`loaded_message` for ``validate``/``test``/``predict``, which load weights and resume nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.elastic import ElasticPolicy
from lightning_ft.elastic.internal import (
    ReplicaBatchPlan,
    ResumeDecision,
    ScaledLearningRates,
    check_replica_policy,
    plan_replica_batch,
    plan_resume_from_metadata,
    previous_world,
    replica_policy_message,
    resume_timing,
    resumed_rng_states,
)
from lightning_ft.events import EventLog, process_start_time, read_events

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D


class ElasticResume(Callback):
    """Decides and applies an elastic resume; see the module docstring. Users never add it themselves.

    Args:
        policy: the strategy's ``elastic=`` (``None`` refuses a new data-parallel size).
        event_log: returns the event log (``None`` before it is open).
        sizes: returns ``(world_size, data_parallel_size, tensor_parallel_size, pipeline_parallel_size, mesh)`` of
            the current run.
    """

    def __init__(
        self,
        *,
        policy: ElasticPolicy | None,
        event_log: Callable[[], EventLog | None],
        sizes: Callable[[], tuple[int, int, int, int, dict[str, int]]],
    ) -> None:
        self.policy = policy
        self.rates = ScaledLearningRates()
        self._event_log = event_log
        self._sizes = sizes
        self._loaded: dict[str, Any] | None = None
        self._saved_scale = 1.0
        self._accumulate_set: int | None = None
        self._configured_accumulate: int | None = None
        self._pending_event: dict[str, Any] | None = None
        self._last_step: tuple[int, float] | None = None
        self._resumed_written = False
        self._replica: dict[str, Any] | None = None  # the replica mode's sizes (use_replica_groups)
        self._replica_accumulate: int | None = None  # the accumulation at the full membership (on_train_start)
        self._replica_batch: int | None = None  # the per-device batch (on_train_start)
        self._replica_live: int | None = None  # the live groups the policy was last applied to

    @classmethod
    def of(cls, strategy: ElasticFT3D) -> ElasticResume:
        """The instance for ``strategy``: its policy, its event log, its sizes once processes exist."""

        def sizes() -> tuple[int, int, int, int, dict[str, int]]:
            cfg = strategy.parallel_config
            assert cfg is not None
            tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
            return strategy.world_size, cfg.data_parallel_size, tp, pp, strategy.mesh_shape()

        return cls(policy=strategy.elastic, event_log=lambda: strategy.event_log, sizes=sizes)

    @property
    @override
    def state_key(self) -> str:
        return "lightning_ft._ElasticResume"

    # -- called by the strategy -----------------------------------------------------------------------------------

    def checkpoint_loaded(
        self,
        path: Path,
        metadata: dict[str, Any],
        *,
        load_start_time: float,
        load_end_time: float,
        tier: str = "durable",
        restored_from: dict[str, int] | None = None,
    ) -> None:
        """Record the checkpoint ``load_checkpoint`` put in place; restores the learning-rate scale state. Every
        rank calls it; no communication. ``tier`` (``"durable"``, ``"local"``, ``"peer"``) and ``restored_from``
        (ranks per tier) go into the ``resumed`` event."""
        self._loaded = {
            "path": path,
            "metadata": metadata,
            "load_start_time": load_start_time,
            "load_end_time": load_end_time,
            "tier": tier,
            "restored_from": restored_from,
        }
        state = metadata.get("lr_scale_state")
        if state:
            # The saved optimizer rates carry the factor in force when they were saved.
            self.rates.scale.load_state_dict(state)
            self._saved_scale = float(metadata.get("lr_scale") or 1.0)
        else:
            # lightning-ft 0.1.0 saved unscaled rates and only the factor of the save's step.
            self.rates.scale.load_constant(float(metadata.get("lr_scale") or 1.0))
            self._saved_scale = 1.0
        replica = metadata.get("replica_lr_scale_state")
        if replica:  # a whole-job restart of replica groups: the live groups' factor goes on from the save's
            self.rates.replica.load_state_dict(replica)
            self._replica_live = metadata.get("replica_live_groups")

    def rng_states(self, saved: dict[str, Any] | None, *, rank: int, saved_rank: int) -> dict[str, Any] | None:
        """The RNG states this rank continues with after the load (see :mod:`lightning_ft.elastic.rank_rng`)."""
        step = int((self._loaded or {}).get("metadata", {}).get("step") or 0)
        return resumed_rng_states(saved, rank=rank, saved_rank=saved_rank, step=step)

    def metadata(self) -> dict[str, Any]:
        """What every checkpoint's metadata records for the next resume: ``lr_scale`` (the factor the saved optimizer
        rates carry), ``lr_scale_state`` (the ramp, to continue it) and ``configured_accumulate_grad_batches`` (the
        user's own Trainer setting, which the policy may have replaced: a resume compares the new Trainer's with
        it to tell a change the user made from the policy's)."""
        metadata: dict[str, Any] = {
            "lr_scale": self.rates.applied,
            "lr_scale_state": self.rates.scale.state_dict(),
            "configured_accumulate_grad_batches": self._configured_accumulate,
        }
        if self._replica is not None and self._replica_accumulate is not None:
            # Replica groups: the accumulation of the full membership (what a resume rescales from; the one in force
            # follows the live groups) and the live groups' learning-rate factor, apart from the resumes' own.
            metadata["accumulate_grad_batches"] = self._replica_accumulate
            metadata["replica_lr_scale_state"] = self.rates.replica.state_dict()
            metadata["replica_live_groups"] = self._replica_live
        return metadata

    def optimizer_step(self, step: Callable[[], Any], global_step: int) -> Any:
        """Run ``step`` (the optimizer step taken at ``global_step``) with the rates of that step, then set the
        rates of the next one, which is what ``param_groups`` shows until then."""
        self.rates.apply(global_step)
        try:
            return step()
        finally:
            self.rates.apply(global_step + 1)

    # -- replica groups: the policy at a change of the live groups (lightning_ft/elastic/replica_policy.py) --------

    def use_replica_groups(
        self, *, num_groups: int, num_groups_known: bool, min_replicas: int, group_size: int
    ) -> None:
        """This fit is a replica group (the strategy's set-up, every rank): the policy applies at each change of the
        live groups, relative to ``num_groups`` groups of ``group_size`` ranks."""
        self._replica = {
            "num_groups": num_groups,
            "num_groups_known": num_groups_known,
            "min_replicas": min_replicas,
            "group_size": group_size,
        }

    def _check_replica_policy(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``, before any step: the accumulation of the full membership (the Trainer's, or what
        the resume decided), and the policy checked at every membership from ``min_replicas`` to ``num_groups``."""
        if self._replica is None:
            return
        self._replica_accumulate = int(trainer.accumulate_grad_batches)
        self._replica_batch = _per_device_batch_size(trainer)
        check_replica_policy(
            self.policy,
            num_groups=self._replica["num_groups"],
            num_groups_known=self._replica["num_groups_known"],
            min_replicas=self._replica["min_replicas"],
            group_size=self._replica["group_size"],
            device_batch=self._replica_batch,
            accumulate=self._replica_accumulate,
        )
        if self._replica_live is not None:  # a whole-job restart: the membership of the save until the first quorum
            trainer.accumulate_grad_batches = self._accumulate_set = self._replica_plan(
                self._replica_live
            ).accumulate_grad_batches

    def _replica_plan(self, live_groups: int) -> ReplicaBatchPlan:
        assert self._replica is not None and self._replica_accumulate is not None
        return plan_replica_batch(
            self.policy,
            live_groups=live_groups,
            num_groups=self._replica["num_groups"],
            group_size=self._replica["group_size"],
            device_batch=self._replica_batch or 1,
            accumulate=self._replica_accumulate,
        )

    def replica_membership(
        self, trainer: pl.Trainer, live_groups: int, step: int, *, cause: str | None = None
    ) -> dict[str, Any] | None:
        """The quorum of the step at global ``step`` has ``live_groups`` groups: when that changed since the policy
        was last applied (or at the fit's first quorum), set the accumulation on the trainer and ramp the learning
        rate's factor of the live groups, say it on the console in one line (group rank 0; ``cause``, a lost group,
        ends it) and return the ``replica_policy`` event's fields; ``None`` when nothing changed.

        Every rank of every group calls it right after the quorum and before the rest of the epoch is dealt anew
        (the deal reads the accumulation). A healed group calls it after the heal put the source's policy state in
        place (:meth:`load_replica_state`), so it makes the same change at the same step.

        Raises:
            ValueError: ``keep_global`` cannot serve ``live_groups`` (more groups live than ``num_groups`` says, with
                an accumulation that does not divide).
        """
        if self._replica is None or self._replica_accumulate is None or live_groups == self._replica_live:
            return None
        first = self._replica_live is None
        before = self._replica_plan(self._replica_live or self._replica["num_groups"])
        after = self._replica_plan(live_groups)
        trainer.accumulate_grad_batches = self._accumulate_set = after.accumulate_grad_batches
        warmup = self.policy.lr_warmup_steps if self.policy is not None else 0
        self.rates.replica.ramp_to(after.lr_scale, step=step, warmup_steps=warmup)
        self.rates.apply(step)
        self._replica_live = live_groups
        message = replica_policy_message(before, after, first=first, warmup_steps=warmup)
        rank_zero_info(f"{message}; {cause}" if cause else message)
        return {
            "live_groups": live_groups,
            "num_groups": after.num_groups,
            "batch": self.policy.batch if self.policy is not None else None,
            "lr_scaling": self.policy.lr_scaling if self.policy is not None else None,
            "accumulate_grad_batches": after.accumulate_grad_batches,
            "global_batch": after.global_batch,
            "reference_global_batch": after.reference_global_batch,
            "lr_scale": after.lr_scale,
            "lr_scale_now": self.rates.applied,
            "lr_warmup_steps": warmup,
        }

    def replica_state(self) -> dict[str, Any] | None:
        """What a joining group copies with the rest of the state, so that its rates and accumulation are this
        group's bitwise: the run's own (unscaled) rates, the factor they carry, both factors' ramps and the live
        groups the policy was last applied to. Called on torchft's quorum thread while the training thread waits."""
        if self._replica is None:
            return None
        return {
            "unscaled": self.rates.unscaled(),
            "applied": self.rates.applied,
            "scale": self.rates.scale.state_dict(),
            "replica": self.rates.replica.state_dict(),
            "live_groups": self._replica_live,
        }

    def load_replica_state(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        """Put :meth:`replica_state` of the source in place, after the heal loaded the optimizers (their rates are the
        source's). Every rank of the joining group, on the training thread, inside the quorum."""
        if self._replica is None:
            return
        self.rates.scale.load_state_dict(state["scale"])
        self.rates.replica.load_state_dict(state["replica"])
        self.rates.rebind(trainer.optimizers, unscaled=list(state["unscaled"]), applied=float(state["applied"]))
        self._replica_live = state["live_groups"]
        if self._replica_live is not None and self._replica_accumulate is not None:
            trainer.accumulate_grad_batches = self._accumulate_set = self._replica_plan(
                self._replica_live
            ).accumulate_grad_batches

    # -- hooks ------------------------------------------------------------------------------------------------------

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A resume at or past max_steps trains nothing: Lightning's fit loop says "`Trainer.fit` stopped" before any
        # on_train_start, so the resume line comes now (the saved per-device batch stands in for the DataLoader's).
        if self._loaded is None or self._pending_event is not None or trainer.max_steps in (None, -1):
            return
        if int(self._loaded["metadata"].get("step") or 0) >= trainer.max_steps:
            self._decide(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = None
        if self._configured_accumulate is None or trainer.accumulate_grad_batches != self._accumulate_set:
            # What the user's Trainer says, not what an earlier fit of the same Trainer was given by the policy.
            self._configured_accumulate = trainer.accumulate_grad_batches
        if self._loaded is None:
            self.rates.attach(trainer.optimizers, module=pl_module, saved_scale=1.0)
            self.rates.apply(trainer.global_step)
            self._check_replica_policy(trainer)
            return
        decision = self._decide(trainer)
        trainer.accumulate_grad_batches = self._accumulate_set = decision.accumulate_grad_batches
        for callback in trainer.checkpoint_callbacks:
            # The resumed state is saved; the micro-batches before the next step must not save it again half-way.
            _compat.mark_checkpoint_saved_at(callback, trainer.global_step)
        self.rates.scale.resume(decision, step=int(self._loaded["metadata"].get("step") or 0))
        self.rates.attach(trainer.optimizers, module=pl_module, saved_scale=self._saved_scale)
        self.rates.apply(trainer.global_step)
        assert self._pending_event is not None
        self._pending_event.update(lr_scale_now=self.rates.applied, lr_scale_target=self.rates.scale.target)
        self._check_replica_policy(trainer)

    def _decide(self, trainer: pl.Trainer) -> ResumeDecision:
        """The policy's decision for the loaded checkpoint and this Trainer; prepares the ``resumed`` event."""
        assert self._loaded is not None
        metadata = self._loaded["metadata"]
        world_size, dp, tp, pp, mesh = self._sizes()
        batch = _per_device_batch_size(trainer)
        # The Trainer's accumulation is a new choice of the user's only if it differs from the user's own setting in
        # the run that saved (the policy may have replaced that one; a script relaunched unchanged is no new choice).
        configured = self._configured_accumulate or trainer.accumulate_grad_batches
        saved_configured = metadata.get("configured_accumulate_grad_batches")
        decision = plan_resume_from_metadata(
            self.policy,
            metadata,
            new_dp_size=dp,
            new_world_size=world_size,
            new_per_device_batch=batch,
            new_accumulate=configured if saved_configured is not None and configured != saved_configured else None,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        self._pending_event = {
            "step": metadata.get("step"),
            "path": str(self._loaded["path"]),
            "saved_world_size": metadata.get("world_size"),
            "world_size": world_size,
            "saved_mesh": metadata.get("mesh"),
            "mesh": mesh,
            "per_device_batch_size": batch or metadata.get("per_device_batch_size"),
            "accumulate_grad_batches": decision.accumulate_grad_batches,
            "global_batch_before": decision.global_batch_before,
            "global_batch_after": decision.global_batch_after,
            "lr_scale": decision.lr_scale,
            "lr_scale_now": self.rates.scale.at(int(metadata.get("step") or 0)),
            "lr_scale_target": self.rates.scale.target,
        }
        # Here, not at on_train_start: a resume with nothing left to train (max_epochs reached) says it too.
        rank_zero_info(resume_message(self._loaded["path"], metadata, decision=decision, world_size=world_size))
        return decision

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._last_step is None or trainer.global_step != self._last_step[0]:
            self._last_step = (trainer.global_step, time.time())
        if self._pending_event is not None and trainer.global_step > int(self._pending_event["step"] or 0):
            self._write_resumed(trainer, first_step_time=self._last_step[1])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_resumed(trainer, first_step_time=None)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._write_resumed(trainer, first_step_time=None)

    def last_step(self) -> dict[str, Any]:
        """``last_step`` and ``last_step_time`` (Unix seconds) of the last completed training step of this attempt
        (``None`` before the first), for the ``attempt_end`` event."""
        last = self._last_step
        return {"last_step": last[0] if last else None, "last_step_time": last[1] if last else None}

    def finish(self, trainer: pl.Trainer) -> None:
        """The strategy's teardown: record a resume whose training loop never started (nothing left to train, say
        ``max_steps`` already reached) and undo the ``lr_scheduler_step`` wrapper. Every rank calls it."""
        try:
            if trainer.state.fn == TrainerFn.FITTING and self._loaded is not None and not self._resumed_written:
                if self._pending_event is None:
                    self._decide(trainer)
                self._write_resumed(trainer, first_step_time=None)
        finally:
            self.rates.detach()
            self._loaded = None
            self._resumed_written = False
            self._replica = self._replica_accumulate = self._replica_live = None

    def _write_resumed(self, trainer: pl.Trainer, *, first_step_time: float | None) -> None:
        fields, self._pending_event = self._pending_event, None
        if fields is not None:
            self._resumed_written = True
        log = self._event_log()
        if fields is None or self._loaded is None or trainer.global_rank != 0 or log is None:
            return
        previous = previous_world(read_events(log.records), run_id=log.run_id, attempt=log.attempt)
        timing = resume_timing(
            previous,
            process_start_time=process_start_time(),
            load_start_time=self._loaded["load_start_time"],
            load_end_time=self._loaded["load_end_time"],
            first_step_time=first_step_time,
        )
        tier = {"tier": self._loaded.get("tier", "durable"), "restored_from": self._loaded.get("restored_from")}
        log.write("resumed", **fields, **tier, world_change_time=previous.last_step_time, **timing)


def _per_device_batch_size(trainer: pl.Trainer) -> int | None:
    """The batch size of the first training DataLoader (``None`` when it has none, e.g. a custom batch sampler)."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    for loader in loaders:
        if isinstance(loader, DataLoader) and isinstance(loader.batch_size, int):
            return loader.batch_size
    return None


def resume_message(path: Path, metadata: dict[str, Any], *, decision: ResumeDecision, world_size: int) -> str:
    """``lightning-ft: resuming from PATH (step N): world size 2 -> 3, gradient accumulation 1 -> 2, LR x1.00 -> x1.50``.

    The LR factor is relative to the learning rates the run configured: the factor the checkpoint's run trained with
    (earlier elastic resumes) and the one this run trains with once any warm-up of it is over. Values that did not
    change are shown as such.
    """
    saved_world = metadata.get("world_size")
    saved_accumulate = int(metadata.get("accumulate_grad_batches") or 1)
    carried = float(metadata.get("lr_scale") or 1.0)
    lr = _change("LR", f"x{carried:.2f}", f"x{carried * decision.lr_scale:.2f}")
    if decision.lr_scale != 1.0 and decision.lr_warmup_steps > 0:
        lr += f" (ramped in over {decision.lr_warmup_steps} steps)"
    parts = [
        _change("world size", saved_world if saved_world is not None else world_size, world_size),
        _change("gradient accumulation", saved_accumulate, decision.accumulate_grad_batches),
        lr,
    ]
    return f"lightning-ft: resuming from {path} (step {metadata.get('step')}): {', '.join(parts)}"


def loaded_message(path: Path, metadata: dict[str, Any], *, stage: str) -> str:
    """``lightning-ft: loaded weights from PATH (step N) for test``: what validate/test/predict print instead."""
    return f"lightning-ft: loaded weights from {path} (step {metadata.get('step')}) for {stage}"


def _change(name: str, before: Any, after: Any) -> str:
    return f"{name} {after} (unchanged)" if before == after else f"{name} {before} -> {after}"
