"""The strategy's own callback: progress events, the data position and the late RNG restore.

``ElasticFT3D`` inserts one :class:`TrainingTracker` at the front of ``trainer.callbacks`` so that its batch-end hook
runs before ``ModelCheckpoint``'s: the sampler's consumed-sample count must already include the batch whose end
triggers a save. Users never add it themselves.

What it does per training batch, on every rank:

- advances the training data position (the resumable samplers) by one global batch;
- at the end of an epoch the fit resumed in the middle of, lets the iterators of loaders that save their own position
  end (:meth:`~lightning_ft.elastic.internal.TrainingDataPosition.finish_resumed_epoch`);
- after a resume, sets the RNG states saved in the checkpoint where the uninterrupted run's random stream was in
  that state (see :meth:`TrainingTracker.resume_with_rng`), not at load time: between the load and the first step
  Lightning creates dataloader iterators and runs hooks, and whatever they draw would otherwise shift the stream;
- on rank 0, times productive steps and data wait (a :class:`~lightning_ft.batch_timer.BatchTimer`, with the save
  stalls the strategy measured) and writes a ``progress`` event every ``log_every_n_steps`` optimizer steps, at the
  latest :data:`PROGRESS_EVERY_S` seconds after the previous one, when training ends, and when ``fit`` fails (a crash,
  a preemption, a hang the watchdog ends: the steps since the last line are on record before ``attempt_end``), and
  ``first_step`` when the first step of this attempt completes. A process killed outright leaves at most
  ``PROGRESS_EVERY_S`` seconds (or ``log_every_n_steps`` steps) of training without a ``progress`` line;
  ``lightning-ft report`` estimates those from the highest step the attempt recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.batch_timer import BatchTimer
from lightning_ft.events import EventLog

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.elastic.internal import TrainingDataPosition
    from lightning_ft.strategy.checkpoint_io import StrategyCheckpoints

PROGRESS_EVERY_S = 5.0
"""The longest time between two ``progress`` lines while training runs, whatever ``log_every_n_steps`` is: one line
per 5 s (about 200 bytes: 3.5 MB a day on rank 0) costs nothing, and bounds what a process killed outright (SIGKILL,
out of memory) leaves unrecorded to 5 s of training."""


class TrainingTracker(Callback):
    """Per-batch bookkeeping of ``ElasticFT3D``; see the module docstring.

    Args:
        event_log: returns the event log (``None`` before it is open).
        checkpoints: the strategy's checkpoint I/O: its ``take_unaccounted_stall_s()`` returns, and resets, the seconds
            saves blocked the loop since the previous call; its ``replay_logger_calls()`` makes the loggers' calls that
            waited for a commit (at each training batch's start).
        data_position: the strategy's training data position: advanced once per training batch on every rank, before
            any checkpoint callback; it tells this tracker where a resume's RNG states are due, and is told at
            ``on_train_start`` whether the fit resumes.
        attempt_start_time: Unix time this attempt started (``first_step`` reports the time since).
    """

    def __init__(
        self,
        *,
        event_log: Callable[[], EventLog | None],
        checkpoints: StrategyCheckpoints,
        data_position: TrainingDataPosition,
        attempt_start_time: float,
    ) -> None:
        self._event_log = event_log
        self._take_stall_s = checkpoints.take_unaccounted_stall_s
        self._replay_logger_calls = checkpoints.replay_logger_calls
        self._data_position = data_position
        data_position.resume_rng = self
        self._attempt_start_time = attempt_start_time
        self._pending_rng: dict[str, Any] | None = None
        # Of the fit being set up: None (not resuming), "undecided", "mid_epoch" or "epoch_boundary".
        self._resume_point: str | None = None
        self._resumed_mid_epoch = False  # this fit resumed in the middle of the epoch that is running
        self._timer = BatchTimer()
        self._last_progress_step: int | None = None
        self._last_progress_time = time.monotonic()
        self._last_step_time: float | None = None
        self._first_step_written = False

    @property
    @override
    def state_key(self) -> str:
        return "lightning_ft._TrainingTracker"

    def resume_with_rng(self, rng_states: dict[str, Any] | None) -> None:
        """A fit resumes from a checkpoint whose save call saw ``rng_states`` (``None``: none to restore).

        The states are set where the uninterrupted run's stream was at the save call, so that the data pipeline's
        draws come out as they would have (Lightning's training fetcher does not fetch ahead of a sized loader; it
        fetches each batch right before its ``on_train_batch_start``):

        - saved in the middle of an epoch: just before the first fetch of the resumed epoch
          (:meth:`before_first_fetch`, called by the resumable sampler of a loader without workers as it hands out
          its first index), or at the first ``on_train_batch_start`` where every resumable loader has workers (the
          main process draws nothing while they fetch). Lightning has created the DataLoader iterators by then,
          drawing their base seeds from the global torch RNG as the uninterrupted run did at the start of the
          epoch, before the save;
        - saved at an epoch boundary (the epoch's last batch done): just before Lightning creates the next epoch's
          DataLoader iterator (:meth:`before_training_iterator`), which draws its base seed, and with workers their
          seeds, from the restored stream, as the uninterrupted run did after the save;
        - otherwise (no resumable sampler), at the first ``on_train_batch_start``.

        Called by ``load_checkpoint`` on every rank, before the loops are restored.
        """
        self._pending_rng = rng_states
        self._resume_point = "undecided"

    def before_training_iterator(self, trainer: pl.Trainer) -> None:
        """From ``Strategy.process_dataloader`` for each training loader, before Lightning creates their iterator."""
        if self._resume_point != "undecided":
            return
        # Restored from the checkpoint's loop state by now; the epoch loop resets it later.
        at_boundary = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        self._resume_point = "epoch_boundary" if at_boundary else "mid_epoch"
        if at_boundary:
            self._set_pending_rng()

    def before_first_fetch(self) -> None:
        """From a resumable sampler, in the main process, as an iterator hands out its first index (after a resume at
        an epoch boundary the states are set already)."""
        self._set_pending_rng()

    def _take_resume_point(self) -> str | None:
        """``"mid_epoch"``, ``"epoch_boundary"`` or ``None`` (not resuming) for the fit that is starting; once."""
        point, self._resume_point = self._resume_point, None
        return "mid_epoch" if point == "undecided" else point

    def _set_pending_rng(self) -> None:
        if self._pending_rng is not None:
            _compat.set_rng_states(self._pending_rng)
            self._pending_rng = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        point = self._take_resume_point()
        self._resumed_mid_epoch = point == "mid_epoch"
        self._data_position.training_starts(point, trainer.train_dataloader)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resumed_mid_epoch:
            self._resumed_mid_epoch = False
            self._data_position.finish_resumed_epoch(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The wait for the epoch's first batch includes building the dataloader iterator: count it as data wait.
        self._timer.epoch_start(count_wait=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._set_pending_rng()  # not set yet only where no loader fetches in the main process from a resumable sampler
        # A checkpoint save between two batches blocks the loop too; it is accounted as a stall, not data wait.
        self._replay_logger_calls()  # before the batch's clock starts: an upload is no productive time
        self._timer.batch_start(stall_s=self._take_stall_s())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._timer.batch_end()
        self._last_step_time = time.time()
        self._data_position.advance()
        if trainer.global_rank != 0:
            return
        log = self._event_log()
        if log is None:
            return
        step = trainer.global_step
        if not self._first_step_written and step > 0:
            self._first_step_written = True
            log.write("first_step", step=step, since_attempt_start_s=time.time() - self._attempt_start_time)
        every = max(int(trainer.log_every_n_steps or 1), 1)
        due = step % every == 0 or time.monotonic() - self._last_progress_time >= PROGRESS_EVERY_S
        if step > 0 and due and step != self._last_progress_step:
            self._write_progress(log, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write_pending(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Before the strategy's teardown writes attempt_end: the steps trained since the last line are on record.
        self.write_pending(trainer)

    @property
    def timer(self) -> BatchTimer:
        """The timer of this rank's steps, data wait and save stalls: what ``progress`` lines record, and what
        ``GoodputMonitor`` logs under ``ElasticFT3D`` (read on rank 0, from the training loop's thread)."""
        return self._timer

    def write_pending(self, trainer: pl.Trainer) -> None:
        """On rank 0, write a ``progress`` line for what was measured since the last one, if anything: at the end of
        training, when ``fit`` fails, and from the hang watchdog's thread before it ends the process (the main thread
        is stuck then, and the step it last completed is ``trainer.global_step``). A save after the last batch (the
        end of training) has no next batch to book its stall at: it is booked here."""
        self._timer.add_stall(self._take_stall_s())
        log = self._event_log()
        if trainer.global_rank == 0 and log is not None and self._timer.pending():
            self._write_progress(log, trainer.global_step)

    def _write_progress(self, log: EventLog, step: int) -> None:
        productive_s, data_wait_s, stall_s = self._timer.drain()
        self._last_progress_step = step
        self._last_progress_time = time.monotonic()
        # The line may come well after the step (a failed fit, a hang): last_step_time says when the step ended.
        log.write(
            "progress",
            step=step,
            productive_s=productive_s,
            data_wait_s=data_wait_s,
            stall_s=stall_s,
            last_step_time=self._last_step_time,
        )
