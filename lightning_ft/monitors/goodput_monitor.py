"""GoodputMonitor: where the wall time of a run goes, across every attempt, live in the logger.

Rank 0 reads the current attempt's productive time, data wait and checkpoint stalls from a
:class:`~lightning_ft.batch_timer.BatchTimer` (productive time: ``on_train_batch_start`` to ``on_train_batch_end``;
data wait: the gap before a batch; checkpoint stall: the part of a gap a save blocked). Under ``ElasticFT3D`` that is
the strategy's own timer, which measures its save calls and whose drains are the ``progress`` lines
``lightning-ft report`` sums: the logged figures are the report's. Under another strategy the monitor drives a timer
of its own, estimates a stall as the excess of a gap that contains a save over the usual gap, and writes those
``progress`` lines itself. It writes ``first_step`` when the first step of an attempt completes. Previous attempts come from the event log through
:func:`~lightning_ft.monitors.goodput_report.summarize` (which sees the work lost after the last checkpoint), or,
when no log of them exists, from the totals this callback saved in the checkpoint. The rules are the report's: an
attempt that follows a finished one is a continuation, not a restart (no restart time, no lost steps, the gap not
counted). Under a strategy that records no progress of its own (not ``ElasticFT3D``) the monitor opens the event log
(``attempt_start``) and writes ``progress``, ``first_step`` and ``attempt_end`` (``finished`` at the end of training,
``crashed`` or ``stopped`` on an exception), so that ``lightning-ft report`` works there too.

After a restart, the steps an earlier attempt already reached are trained again; ``goodput/*`` is not logged for them
(the earlier values stay in TensorBoard), and the first value logged past them carries ``goodput/replayed_steps``.

In the replica mode (docs/replica-groups.md) a lost group restarts nothing: rank 0 reads the replica events its own
rank appends to the event log (:mod:`~lightning_ft.monitors.replica_goodput`) as they come, counts the steps the
survivors discarded as lost time (their wait for the next quorum is outside the productive time already) and the
heals. A group that heals from a live group before its first step (a replacement) starts at the live step: nothing
before it was lost or is replayed. The live groups themselves are logged by the strategy (``replica/live_groups``),
not here: one tag for one thing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft.batch_timer import BatchTimer
from lightning_ft.events import get_event_log, open_event_log, process_start_time, read_events
from lightning_ft.monitors._replay import replayed_through
from lightning_ft.monitors.goodput_report import summarize
from lightning_ft.monitors.replica_goodput import ReplicaTally, discarded_seconds, read_new_lines
from lightning_ft.monitors.straggler_monitor import STRAGGLER_EXIT_CODE, StragglerMonitor

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
"""The longest time between two logs of the totals while training runs, whatever ``log_every_n_steps`` is."""
PROGRESS_EVERY_S = 5.0
"""Where this monitor writes ``progress`` lines (under a strategy without an event log of its own): the longest time
between two, as the strategy's own (:data:`lightning_ft.strategy.tracker.PROGRESS_EVERY_S`)."""

_TOTAL_KEYS = (
    "wall_s",
    "productive_s",
    "useful_productive_s",
    "data_wait_s",
    "checkpoint_stall_s",
    "restart_s",
    "recovery_s",
    "lost_steps",
    "lost_s",
    "straggler_s",
    "straggler_detections",
    "device_s_held",
    "useful_device_s",
    "attempts",
    "restarts",
    "continuations",
    "replica_stall_s",
    "heal_s",
    "replicas_lost",
    "replicas_joined",
    "discarded_steps",
)


class GoodputMonitor(Callback):
    """Effective training time ratio, device utilisation, restart, lost-work and straggler time, across restarts.

    Logs on rank 0 under ``goodput/*`` every ``log_every_n_steps`` (default: the trainer's), at the latest
    :data:`LOG_EVERY_S` seconds after the previous log, and at the last step of training. Not collective.
    Its state (JSON numbers) is saved in every checkpoint under :attr:`state_key`.

    Args:
        log_every_n_steps: optimizer steps between logs and, under strategies without their own event log,
            ``progress`` events. ``None``: the trainer's ``log_every_n_steps``.

    Example::

        trainer = L.Trainer(callbacks=[GoodputMonitor()])
        trainer.fit(model)
        print(trainer.callbacks[0].totals()["ettr"])
    """

    uses_event_log = True
    """The run keeps its event log on disk from the start (:func:`lightning_ft.events.keeps_records`)."""

    def __init__(self, *, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"GoodputMonitor(log_every_n_steps={log_every_n_steps!r}): must be >= 1 or None")
        self.log_every_n_steps = log_every_n_steps
        self._restored: dict[str, float] = {}
        self._prior: dict[str, float] = {}
        self._prior_counts_current = False
        self._restarted = False
        self._fault_time: float | None = None
        self._writes_progress = False
        self._replayed_through = -1
        self._replayed_steps = 0
        self._reset_attempt()

    def _reset_attempt(self) -> None:
        self._start_time = process_start_time()
        self._world_size = 1
        self._timer = BatchTimer()
        self._loop = self._timer  # the timer whose totals are logged: the strategy's, where it shares one (setup)
        self._logged_loop: tuple[float, ...] | None = None
        self._first_step_time: float | None = None
        self._saved_in_gap = False
        self._last_logged_step = -1
        self._last_logged_time = self._last_progress_time = time.monotonic()
        self._boundary_time: float | None = None
        self._replicas: ReplicaTally | None = None
        self._events_path: Any = None
        self._events_offset = 0
        self._start_step = 0  # the global step this attempt's training started from (a resume's, a heal's)
        self._committed_steps = 0  # steps committed by this attempt so far
        self._before: list[dict[str, Any]] = []  # the earlier attempts' events, for the prior totals

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(log_every_n_steps=self.log_every_n_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_attempt()
        self._world_size = trainer.world_size
        # Opens the log (collective, every rank is here) unless the strategy did; whoever set up first records progress,
        # with its timer: this monitor then logs that timer's totals rather than timing the same steps again.
        log = open_event_log(trainer)
        self._writes_progress = log.claim("progress", timer=self._timer)
        self._loop = log.claimed_timer("progress") or self._timer

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._restarted, self._fault_time = False, None
        self._replayed_through = replayed_through(trainer)
        self._replayed_steps = max(self._replayed_through - trainer.global_step, 0)
        self._start_step = trainer.global_step
        event_log = get_event_log(trainer)
        self._replicas = ReplicaTally(run_id=event_log.run_id, attempt=event_log.attempt)
        self._events_path, self._events_offset = event_log.path, 0
        self._before = [
            e
            for e in read_events(event_log.path.parent)
            if e.get("run_id") == event_log.run_id and int(e.get("attempt", 0) or 0) < event_log.attempt
        ]
        if self._before:
            self._prior_from_log(event_log, trainer.global_step)
        elif self._restored:
            # No record of earlier attempts here: the checkpoint's totals, which miss the work after that checkpoint
            # and cannot tell how the attempt ended; counted as a restart from this process's start.
            self._prior = dict(self._restored)
            self._prior_counts_current = False
            self._restarted = True
            self._fault_time = self._start_time

    def _prior_from_log(self, event_log: Any, start_step: int) -> None:
        """The earlier attempts' totals from the log, with the current attempt as summarize() will see it once it
        has run: started at process start, resumed at ``start_step``. That makes the lost work and the gap before
        this attempt part of the prior."""
        current = {"run_id": event_log.run_id, "attempt": event_log.attempt, "rank": 0, "time": self._start_time}
        s = summarize(
            [
                *self._before,
                {**current, "event": "attempt_start", "step": None, "world_size": self._world_size},
                {**current, "event": "resumed", "step": start_step},
            ]
        )
        t = s["totals"]
        self._prior = {k: float(t[k]) for k in _TOTAL_KEYS if k in t}
        self._prior["useful_device_s"] = sum((a["productive_s"] - a["lost_s"]) * a["world_size"] for a in s["attempts"])
        self._prior["straggler_detections"] = float(s["stragglers"]["count"])
        restart = next((r for r in s["restarts"] if r["attempt"] == event_log.attempt), None)
        self._restarted = restart is not None
        self._fault_time = restart["fault_time"] if restart is not None else None
        self._prior_counts_current = True

    def _after_heal(self, trainer: pl.Trainer) -> None:
        """This attempt healed from a live group before its first step (a replacement group): it starts at the live
        step, which the live groups committed. Nothing an earlier attempt reached below it was lost, none of it is
        trained again (rank 0, at the first step's end)."""
        heals = (self._replicas.summary or {}).get("heals", []) if self._replicas is not None else []
        step = next((h["step"] for h in heals if isinstance(h.get("step"), int)), None)
        if step is None or step <= self._start_step:
            return
        self._start_step = step
        self._replayed_steps = max(self._replayed_through - step, 0)
        if self._before:
            self._prior_from_log(get_event_log(trainer), step)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._loop is self._timer:
            self._timer.batch_start(saved=self._saved_in_gap)
        self._saved_in_gap = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._loop is self._timer:
            self._timer.batch_end()
        self._at_boundary()
        if not trainer.is_global_zero:
            return
        self._read_replica_events()
        if self._first_step_time is None:
            self._after_heal(trainer)
            self._first_step_time = time.time()
            if self._writes_progress:  # under ElasticFT3D the strategy writes first_step and progress itself
                get_event_log(trainer).write(
                    "first_step", since_attempt_start_s=self._first_step_time - self._start_time
                )
        self._committed_steps = max(trainer.global_step - self._start_step, 0)
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        step = trainer.global_step
        now = time.monotonic()
        if step == self._last_logged_step:
            return
        if step % every == 0 or now - self._last_logged_time >= LOG_EVERY_S:
            self._log_at(trainer, step)
        elif self._writes_progress and now - self._last_progress_time >= PROGRESS_EVERY_S:
            self._write_progress(trainer)

    def _read_replica_events(self) -> None:
        """Read the replica events written since the last call into the totals (rank 0)."""
        if self._replicas is None or self._events_path is None:
            return
        lines, self._events_offset = read_new_lines(self._events_path, self._events_offset)
        self._replicas.add(lines)

    def _log_at(self, trainer: pl.Trainer, step: int) -> None:
        """Write ``progress`` (where this monitor does) and log the totals at ``step`` (rank 0)."""
        self._last_logged_step = step
        self._last_logged_time = time.monotonic()
        if self._writes_progress and self._timer.pending():
            self._write_progress(trainer)
        if step > self._replayed_through:  # an earlier attempt logged the steps up to there
            metrics = {f"goodput/{k}": v for k, v in self.totals(trainer).items() if v is not None}
            if self._replayed_steps:
                metrics["goodput/replayed_steps"] = float(self._replayed_steps)
                self._replayed_steps = 0
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            self._logged_loop = tuple(self._loop.totals())

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop is self._timer:
            self._timer.epoch_start(count_wait=False)  # dataloader start-up is not a steady-state data wait

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop is self._timer:
            self._timer.pause()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._saved_in_gap = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last step's totals are logged too: a run shorter than log_every_n_steps still gets its points, and the
        # stall of a save after the last batch (booked by the strategy's tracker at its on_train_end, which runs first).
        if (
            trainer.is_global_zero
            and self._first_step_time is not None
            and (trainer.global_step != self._last_logged_step or tuple(self._loop.totals()) != self._logged_loop)
        ):
            self._log_at(trainer, trainer.global_step)
        if not self._writes_progress:
            return
        if trainer.is_global_zero and self._timer.pending():
            self._write_progress(trainer)
        get_event_log(trainer).write("attempt_end", reason="finished")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._writes_progress:
            return
        if trainer.is_global_zero and self._timer.pending():  # the steps since the last line, before the end
            self._write_progress(trainer)
        # A StragglerMonitor stop and an interrupt from the keyboard end the attempt on purpose; anything else crashed.
        stopped = isinstance(exception, KeyboardInterrupt) or (
            isinstance(exception, SystemExit) and exception.code == STRAGGLER_EXIT_CODE
        )
        get_event_log(trainer).write("attempt_end", reason="stopped" if stopped else "crashed", error=repr(exception))

    def _write_progress(self, trainer: pl.Trainer) -> None:
        self._last_progress_time = time.monotonic()
        productive_s, data_wait_s, stall_s = self._timer.drain()
        get_event_log(trainer).write("progress", productive_s=productive_s, data_wait_s=data_wait_s, stall_s=stall_s)

    def totals(self, trainer: pl.Trainer | None = None, *, now: float | None = None) -> dict[str, float | None]:
        """Totals over all attempts so far (previous ones from the event log or the checkpoint), plus the ratios, with
        the wall time counted up to ``now`` (Unix seconds; ``None``: the present).

        Keys: those of ``summarize()["totals"]`` that apply, ``useful_device_s``, ``ettr`` and ``device_utilisation``.
        """
        p = self._prior
        now = time.time() if now is None else now
        wall_now = now - self._start_time
        straggler_s = 0.0
        detections = 0
        if trainer is not None:
            for cb in trainer.callbacks:
                if isinstance(cb, StragglerMonitor):
                    straggler_s += cb.lost_s
                    detections += len(cb.detections)
        restart_now = recovery_now = 0.0
        if self._restarted and self._first_step_time is not None:
            restart_now = self._first_step_time - (self._fault_time or self._start_time)
            recovery_now = self._first_step_time - self._start_time
        replicas = self._replicas
        stall_now = replicas.stall_s if replicas is not None else 0.0
        discarded_now = discarded_seconds(self._discarded_steps(), self._loop.productive_s, self._committed_steps)

        def replica_total(key: str) -> float:
            return p.get(key, 0.0) + (replicas.total(key) if replicas is not None else 0.0)

        out: dict[str, float | None] = {
            "attempts": p.get("attempts", 0.0) + (0 if self._prior_counts_current else 1),
            "restarts": p.get("restarts", 0.0) + (1 if self._restarted and not self._prior_counts_current else 0),
            "continuations": p.get("continuations", 0.0),
            "wall_s": p.get("wall_s", 0.0) + wall_now,
            "productive_s": p.get("productive_s", 0.0) + self._loop.productive_s,
            "useful_productive_s": p.get("useful_productive_s", 0.0)
            + max(self._loop.productive_s - discarded_now, 0.0),
            "data_wait_s": p.get("data_wait_s", 0.0) + self._loop.data_wait_s,
            "checkpoint_stall_s": p.get("checkpoint_stall_s", 0.0) + self._loop.stall_s,
            "restart_s": p.get("restart_s", 0.0) + restart_now,
            "recovery_s": p.get("recovery_s", 0.0) + recovery_now,
            "lost_steps": p.get("lost_steps", 0.0),
            "lost_s": p.get("lost_s", 0.0) + discarded_now,
            "straggler_s": p.get("straggler_s", 0.0) + straggler_s,
            "straggler_detections": p.get("straggler_detections", 0.0) + detections,
            "replica_stall_s": p.get("replica_stall_s", 0.0) + stall_now,
            **{k: replica_total(k) for k in ("heal_s", "replicas_lost", "replicas_joined", "discarded_steps")},
        }
        held = p.get("device_s_held", 0.0) + self._world_size * wall_now
        useful_dev = p.get("useful_device_s", 0.0) + self._world_size * max(
            self._loop.productive_s - discarded_now, 0.0
        )
        out["device_s_held"] = held
        out["useful_device_s"] = useful_dev
        out["ettr"] = out["useful_productive_s"] / out["wall_s"] if out["wall_s"] else None  # type: ignore[operator]
        out["device_utilisation"] = useful_dev / held if held > 0 else None
        return out

    def _discarded_steps(self) -> int:
        """Steps this attempt discarded when groups were lost (each step once, however many groups it lost)."""
        summary = self._replicas.summary if self._replicas is not None else None
        by_step: dict[Any, int] = {}
        for r in (summary or {}).get("lost", []):
            by_step[r.get("step")] = max(by_step.get(r.get("step"), 0), int(r.get("discarded_steps") or 0))
        return sum(by_step.values())

    @override
    def state_dict(self) -> dict[str, Any]:
        # The totals as of the loop's last boundary (batch end, validation end, epoch end: every point where
        # Lightning's ModelCheckpoint saves, after this callback's hook), not of the call: two saves of one step (the
        # top-k checkpoint, then `last`) then hold the same state and share one copy.
        return {k: v for k, v in self.totals(now=self._boundary_time).items() if v is not None and k in _TOTAL_KEYS}

    def _at_boundary(self) -> None:
        self._boundary_time = time.time()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_boundary()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_boundary()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = {k: float(v) for k, v in state_dict.items() if k in _TOTAL_KEYS}
