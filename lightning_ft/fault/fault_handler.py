"""``FaultHandler``: what ``ElasticFT3D`` runs for its ``FaultPolicy`` during ``fit``.

The strategy owns one :class:`FaultHandler` per ``FaultPolicy`` and calls three methods: :meth:`install` at
``setup_environment`` (flag-only signal handlers replace Lightning's; the handler joins ``trainer.callbacks``, last,
so that a preemption checkpoint sees the state every other callback's batch-end hook left, as ``ModelCheckpoint``
does), :meth:`preflight` in ``setup`` (hang watchdog, health checks, the agreement group), and :meth:`uninstall` at
teardown. As a callback it marks progress points for the watchdog and, at every step boundary, after validation and
at the end of training, asks the ranks whether any of them received a preemption signal; when they agree, every rank
commits ``preempt-step=<N>``, writes ``preempted`` and exits with ``FaultPolicy.exit_code``. Every
``FaultPolicy.health_check_every_n_steps`` steps, at the step boundary and before that question, it runs the periodic
health checks (:mod:`~lightning_ft.fault.periodic_health`, collective) and acts on a failure as
``FaultPolicy.health_check_action`` says, in one place (``_health_check_failed``).

So that a hang names the rank the others wait for, the handler wraps torch.distributed's blocking collectives while
``fit`` runs (:func:`~lightning_ft.fault.collective_waits.collective_patches`, undone by :meth:`FaultHandler.uninstall`): the main
thread's entry and exit go to :class:`~lightning_ft.fault.heartbeat.Progress`, and the heartbeat says since when the
rank has been waiting in one. DDP's gradient all-reduce runs inside backward, in C++, out of reach of the wrappers;
the ``before_backward`` point marks the rank as waiting in ``"ddp_backward"`` until the next point when the backward
synchronizes gradients.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.checkpoint.internal import discovery
from lightning_ft.events import STATE_DIR, EventLog, state_root
from lightning_ft.fault import eviction, health, slurm
from lightning_ft.fault.agreement import StopAgreement, StopDecision
from lightning_ft.fault.collective_waits import collective_patches
from lightning_ft.fault.fault_policy import FaultPolicy
from lightning_ft.fault.heartbeat import HeartbeatBoard, Progress
from lightning_ft.fault.periodic_health import CollectiveTiming, PeriodicHealthCheck
from lightning_ft.fault.signals import PreemptionSignals
from lightning_ft.fault.watchdog import Watchdog
from lightning_ft.stop import attempt_end_fields, checkpoint_and_stop, preempt_checkpoint_path

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_STORE_TIMEOUT = timedelta(seconds=30)
AGREEMENT_BUDGET_S = 1.0
"""Training time between two preemption checks, about (see :mod:`~lightning_ft.fault.agreement`)."""


class FaultHandler(Callback):
    """Preemption, hang watchdog and health checks for one ``fit``; see the module docstring.

    Args:
        policy: the strategy's ``FaultPolicy``.
        nvml: NVML for the ``gpu`` health check (``None``: the real one on CUDA devices; tests pass a ``FakeNVML``).
    """

    def __init__(self, policy: FaultPolicy, *, nvml: Any = None) -> None:
        self.policy = policy
        self.nvml = nvml
        self.signals = PreemptionSignals(policy.preemption_signals)
        self.progress = Progress()
        self.watchdog: Watchdog | None = None
        self.agreement: StopAgreement | None = None
        self._event_log: EventLog | None = None
        self._active = False
        self._started = False  # start() ran in this fit
        self._last_step: int | None = None
        self._store: Any = None
        self._collective_patches: list[_compat.Patch] = []
        self.periodic: PeriodicHealthCheck | None = None
        self.before_hang_exit: Callable[[], None] | None = None
        """Called by the watchdog's thread when it fires, before it records the hang (the strategy's tracker writes
        the ``progress`` measured since its last line there)."""

    @property
    @override
    def state_key(self) -> str:
        return "lightning_ft._FaultHandler"

    # ------------------------------------------------------------------ strategy-facing

    @property
    def runs_health_checks(self) -> bool:
        """Whether :meth:`preflight` checks the checkpoint folders (installed for ``fit`` with health checks on)."""
        return self._active and self.policy.health_checks

    def install(self, trainer: pl.Trainer, event_log: EventLog | None) -> None:
        """At ``setup_environment``, for ``fit`` only: signal handlers (for the run stage) and the callback."""
        if trainer.state.fn != TrainerFn.FITTING or self._active:
            return
        self._active = True
        self._started = False
        self._event_log = event_log
        self.progress = Progress()
        self._last_step = None
        if self.policy.health_check_every_n_steps is not None:
            self.periodic = PeriodicHealthCheck(slowdown=self.policy.health_check_slowdown, nvml=self.nvml)
        self.signals.install(trainer)
        progress = self.progress
        self._collective_patches = collective_patches(
            progress.enter_collective,
            progress.leave_collective,
            thread_id=threading.get_ident(),
            name="lightning-ft hang naming",
        )
        for patch in self._collective_patches:
            patch.install()
        trainer.callbacks.append(self)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled strategy (a deep-copied Trainer, torch.save(model)) carries the configuration, not the run.
        return {"policy": self.policy, "nvml": self.nvml}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["policy"], nvml=state["nvml"])  # type: ignore[misc]

    def start(self, trainer: pl.Trainer) -> None:
        """Before the first load of a ``fit`` (which in data parallel comes before the strategy's ``setup``), on every
        rank: refuse a node in its cooldown, check that eviction can work, start the watchdog (which then guards the
        load). Once per fit; :meth:`preflight` runs it if nothing did.

        Collective. Raises :class:`~lightning_ft.stop.NodeStop` on every rank when a node's health record is in its
        cooldown (:func:`~lightning_ft.fault.eviction.refuse_if_unhealthy`), before anything else.
        """
        if not self._active or self._started:
            return
        self._started = True
        if self.policy.refuse_unhealthy_nodes:
            eviction.refuse_if_unhealthy(trainer)
        if self.policy.health_check_action == "evict" and self.policy.health_check_every_n_steps is not None:
            eviction.check_can_evict("FaultPolicy(health_check_action='evict')", trainer)
        self._start_watchdog(trainer)

    def preflight(self, trainer: pl.Trainer, *, check_dir: Callable[[str], None]) -> None:
        """In the strategy's ``setup``, once the optimizers exist (the checkpoint size estimate counts their state), on
        every rank: :meth:`start` if nothing did, run the health checks, open the agreement.

        Collective. Raises ``ValueError`` or :class:`~lightning_ft.fault.health.HealthCheckError` on every rank when
        a check failed on any rank, and what :meth:`start` raises.
        """
        if not self._active:
            return
        if not self._started:
            self.start(trainer)
        if self.policy.health_checks:
            self._health_checks(trainer, check_dir)
        timeout = timedelta(seconds=self.policy.first_step_timeout_s + self.policy.grace_s)
        # Checks about once a second (a twentieth of the grace period if that is shorter): a signal is acted upon
        # within about two of them, well inside grace_s.
        budget_s = min(AGREEMENT_BUDGET_S, self.policy.grace_s / 20.0)
        self.agreement = StopAgreement(self.signals, timeout=timeout, budget_s=budget_s)

    def uninstall(self, trainer: pl.Trainer | None, *, failed: bool) -> None:
        """At teardown: put the signal handlers back, stop the watchdog, release the agreement group. Idempotent."""
        if not self._active:
            return
        self._active = False
        for patch in reversed(self._collective_patches):
            patch.undo()
        self._collective_patches = []
        self.signals.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.agreement is not None:
            agreement, self.agreement = self.agreement, None
            agreement.close(wait=not failed)
        self._store = None
        if trainer is not None and self in trainer.callbacks:
            trainer.callbacks.remove(self)

    # ------------------------------------------------------------------ set-up pieces

    def _start_watchdog(self, trainer: pl.Trainer) -> None:
        log_ = self._event_log
        board = None
        world_size = trainer.world_size
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            env = trainer.strategy.cluster_environment
            try:
                # A client of its own: a slow heartbeat read never holds up the training group's store traffic, and
                # its timeout is short.
                self._store = dist.TCPStore(
                    env.main_address, env.main_port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False
                )
                run = f"{log_.run_id}/attempt{log_.attempt}" if log_ is not None else "run"
                board = HeartbeatBoard(self._store, prefix=f"lightning_ft/heartbeat/{run}", world_size=world_size)
            except Exception as err:  # noqa: BLE001 - the watchdog still guards this rank alone
                log.warning("lightning-ft watchdog: no heartbeat store (%s); hangs will name this rank only", err)
        attempt = log_.attempt if log_ is not None else 0
        stacks = (
            Path(state_root(trainer.default_root_dir))
            / STATE_DIR
            / "hangs"
            / f"attempt{attempt}-rank{trainer.global_rank}.txt"
        )
        self.watchdog = Watchdog(
            progress=self.progress,
            rank=trainer.global_rank,
            hang_timeout_s=self.policy.hang_timeout_s,
            first_step_timeout_s=self.policy.first_step_timeout_s,
            board=board,
            event_log=log_,
            stacks_path=stacks,
            on_tick=self._arm_grace_on_signal,
            before_hang_exit=lambda: self.before_hang_exit() if self.before_hang_exit is not None else None,
        )
        self.watchdog.start()

    def _health_checks(self, trainer: pl.Trainer, check_dir: Callable[[str], None]) -> None:
        started = time.perf_counter()
        rank, strategy = trainer.global_rank, trainer.strategy
        callbacks = [
            cb
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and getattr(cb, "dirpath", None)
        ]
        dirpaths = [cb.dirpath for cb in callbacks]
        retained = {Path(cb.dirpath): cb.save_top_k for cb in callbacks}
        model = strategy.lightning_module
        ckpt_bytes = health.estimate_checkpoint_bytes(model, list(strategy.optimizers)) if model is not None else 0

        def keep(dirpath: Path) -> int:
            # save_top_k=-1 keeps every checkpoint, which no estimate bounds: ask for the next one only.
            top_k = max(retained.get(dirpath, 1), 1)
            existing = len(discovery.list_committed(dirpath)) if dirpath.is_dir() else 0
            return max(top_k - existing, 0)

        failures = health.check_checkpoint_dirs(
            rank, dirpaths, checkpoint_bytes=ckpt_bytes, keep=keep, check_dir=check_dir
        )
        bad, busbw = health.check_collective(rank, trainer.world_size, strategy.root_device)
        latency = health.measure_latency(trainer.world_size, strategy.root_device)
        failures += bad
        failures += health.check_gpu(rank, strategy.root_device, self.nvml)
        info = {"rank": rank, "allreduce_busbw_gbps": busbw, "allreduce_latency_s": latency}
        failures, infos = health.exchange(failures, info)
        if self.periodic is not None:
            self.periodic.baseline = CollectiveTiming.from_infos(infos)
        if rank == 0 and self._event_log is not None:
            fields = {
                "periodic": False,
                "checks": list(health.CHECKS),
                "duration_s": time.perf_counter() - started,
                "checkpoint_bytes_estimate": ckpt_bytes,
                "allreduce_busbw_gbps": busbw,
                "allreduce_latency_s": latency,
            }
            if failures:
                failed = [{"rank": f.rank, "check": f.check, "detail": f.detail} for f in failures]
                self._event_log.write("health_check_failed", step=None, **{**fields, "checks": failed})
            else:
                self._event_log.write("health_check", step=None, passed=True, **fields)
        health.raise_if_failed(failures, trainer.world_size)

    # ------------------------------------------------------------------ periodic health checks

    def _periodic_health_check(self, trainer: pl.Trainer) -> None:
        """At a step boundary, on every rank: the periodic checks when the step is due, then the action on failure.

        Collective when due (every rank passes the same boundaries with the same ``global_step``).
        """
        every, step = self.policy.health_check_every_n_steps, trainer.global_step
        if self.periodic is None or every is None or step == 0 or step % every:
            return
        rank, world_size = trainer.global_rank, trainer.world_size
        failures = self.periodic.run(rank, world_size, trainer.strategy.root_device)
        action = self.policy.health_check_action
        if rank == 0 and self._event_log is not None:
            fields = {"periodic": True, "action": action, **self.periodic.last}
            if failures:
                failed = [{"rank": f.rank, "check": f.check, "detail": f.detail} for f in failures]
                ranks = sorted({f.rank for f in failures})
                self._event_log.write("health_check_failed", checks=failed, ranks=ranks, **fields)
            else:
                self._event_log.write("health_check", passed=True, checks=list(health.PERIODIC_CHECKS), **fields)
        if failures:
            self._health_check_failed(trainer, failures)

    def _health_check_failed(self, trainer: pl.Trainer, failures: list[health.Failure]) -> None:
        """What every rank does about a failed periodic check: the one place that dispatches on
        ``FaultPolicy.health_check_action``. Every rank calls it with the same ``failures``; collective for the
        actions that stop (the checkpoint)."""
        action = self.policy.health_check_action
        outcome = {
            "log": "training goes on (FaultPolicy.health_check_action='log')",
            "checkpoint_and_stop": (
                f"every rank saves {preempt_checkpoint_path(trainer)} and exits with code {self.policy.exit_code}"
            ),
            "evict": (
                "the node of each failing rank leaves the job, its replica group leaves the quorum without a checkpoint"
                " (the live groups hold the state) and the other groups go on (FaultPolicy.health_check_action='evict')"
                if action == "evict" and eviction.in_replica_groups(trainer)
                else f"every rank saves {preempt_checkpoint_path(trainer)}; the node of each failing rank leaves the"
                " job and the others restart without it (FaultPolicy.health_check_action='evict')"
            ),
        }[action]
        message = health.describe(
            failures, trainer.world_size, when=f"periodic (step {trainer.global_step})", outcome=outcome
        )
        if trainer.is_global_zero or any(f.rank == trainer.global_rank for f in failures):
            log.warning(message)
        if action == "checkpoint_and_stop":
            checkpoint_and_stop(trainer, exit_code=self.policy.exit_code, reason="stopped")
        if action == "evict":
            first_line = message.splitlines()[0]
            eviction.evict_node(
                trainer, ranks=sorted({f.rank for f in failures}), source="health_check", reason=first_line
            )

    # ------------------------------------------------------------------ callback hooks

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.progress.mark("batch_start", trainer.global_step)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        model = trainer.strategy.model
        # DDP all-reduces the gradients inside backward, unless Lightning accumulates under `no_sync`.
        synchronizes = isinstance(model, DistributedDataParallel) and model.require_backward_grad_sync
        self.progress.mark_backward(trainer.global_step, synchronizes=synchronizes)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.progress.mark("after_backward", trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        boundary = step != self._last_step
        self._last_step = step
        self.progress.complete("batch_end", step, training=boundary)
        # Only at optimizer-step boundaries: every rank passes the same ones, and a checkpoint between micro-batches
        # of one accumulated step would hold half a step.
        if boundary:
            self._periodic_health_check(trainer)
        if boundary and self.agreement is not None:
            self._act(trainer, self.agreement.poll())

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self.progress.complete("validation_batch_end", trainer.global_step, training=False)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self.agreement is not None:
            self._act(trainer, self.agreement.now())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.progress.mark("train_end", trainer.global_step)
        if self.agreement is not None:
            self._act(trainer, self.agreement.now())

    # ------------------------------------------------------------------ stopping

    def _arm_grace_on_signal(self, now: float) -> None:
        # Runs in the watchdog thread: the deadline holds even if the main thread never reaches a step boundary.
        received = self.signals.received
        if received is not None and self.watchdog is not None:
            self.watchdog.arm_deadline(received.time + self.policy.grace_s, self.policy.exit_code, self._grace_expired)

    def _grace_expired(self) -> None:
        received = self.signals.received
        log.error(
            "lightning-ft: no preemption checkpoint within grace_s=%.0f s of the signal; exiting with code %d",
            self.policy.grace_s,
            self.policy.exit_code,
        )
        if self._event_log is not None:
            self._event_log.write(
                "preempted",
                signal=received.name if received else None,
                signal_time=received.time if received else None,
                checkpoint_path=None,
                exit_code=self.policy.exit_code,
                grace_expired=True,
            )
            self._event_log.write("attempt_end", reason="preempted", exit_code=self.policy.exit_code)

    def _act(self, trainer: pl.Trainer, decision: StopDecision | None) -> None:
        if decision is None:
            return
        agreed_time = time.time()
        if self.watchdog is not None:
            self.watchdog.suspend()
            self.watchdog.arm_deadline(
                decision.signal_time + self.policy.grace_s, self.policy.exit_code, self._grace_expired
            )
        own = self.signals.received
        name = signal.Signals(decision.signum).name

        def committed(path: Path) -> None:
            requeued = None
            if trainer.is_global_zero and slurm.should_requeue(decision.signum):
                requeued = slurm.requeue()
            if self._event_log is not None:
                self._event_log.write(
                    "preempted",
                    signal=name,
                    signal_time=decision.signal_time,
                    signal_ranks=list(decision.signal_ranks),
                    own_signal=own.name if own else None,
                    signals_received=self.signals.count,
                    agreed_time=agreed_time,
                    checkpoint_path=str(path),
                    checkpoint_s=time.time() - agreed_time,
                    exit_code=self.policy.exit_code,
                    slurm_requeued=requeued,
                )

        log.warning(
            "lightning-ft: %s received by rank(s) %s; every rank saves %s and exits with code %d",
            name,
            list(decision.signal_ranks),
            preempt_checkpoint_path(trainer),
            self.policy.exit_code,
        )
        checkpoint_and_stop(trainer, exit_code=self.policy.exit_code, reason="preempted", on_committed=committed)


def end_attempt(
    handler: FaultHandler | None,
    trainer: pl.Trainer | None,
    event_log: EventLog | None,
    exception: BaseException | None,
    **fields: Any,
) -> None:
    """At the strategy's teardown: undo ``handler``'s run (if any) and, after ``fit``, write ``attempt_end``.

    ``exception`` is what ended ``fit`` (``None``: it returned); see :func:`~lightning_ft.stop.attempt_end_fields`.
    ``fields`` are added to the event (the strategy's ``last_step`` and ``last_step_time``). Written with or without a
    ``FaultPolicy``: the event log's account of attempts does not depend on it.
    """
    if handler is not None:
        handler.uninstall(trainer, failed=exception is not None)
    if trainer is not None and event_log is not None and trainer.state.fn == TrainerFn.FITTING:
        event_log.write("attempt_end", **attempt_end_fields(exception), **fields)
        event_log.release_claim()  # the run is no longer live: a relaunch from this folder continues it
