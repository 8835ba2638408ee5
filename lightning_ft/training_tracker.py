"""The strategy's own callback: progress events, data position and the late RNG restore.

``ElasticFT3D`` inserts one ``_TrainingTracker`` at the front of ``trainer.callbacks`` so that its batch-end hook runs
before ``ModelCheckpoint``'s: the sampler's consumed-sample count must already include the batch whose end triggers
a save. It is private: users never add it themselves.

What it does per training batch, on every rank:

- advances the resumable sampler by one global batch (per-device batch x data-parallel size);
- on the first batch after a resume, sets the RNG states saved in the checkpoint. Setting them here rather than at
  load time matters: between the load and the first step Lightning creates dataloader iterators and runs hooks, and
  whatever they draw would otherwise shift the random stream against an uninterrupted run;
- on rank 0, sums productive step time and data wait and writes a ``progress`` event every ``log_every_n_steps``
  optimizer steps, and writes ``first_step`` when the first step of this attempt completes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.strategy import ElasticFT3D


class _TrainingTracker(Callback):
    def __init__(self, strategy: ElasticFT3D) -> None:
        self._strategy = strategy
        self._pending_rng: dict[str, Any] | None = None
        self._batch_start: float | None = None
        self._last_batch_end: float | None = None
        self._productive_s = 0.0
        self._data_wait_s = 0.0
        self._last_progress_step: int | None = None
        self._first_step_written = False

    @property
    @override
    def state_key(self) -> str:
        return "lightning_ft._TrainingTracker"

    def restore_rng_at_next_batch(self, rng_states: dict[str, Any]) -> None:
        self._pending_rng = rng_states

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The wait for the epoch's first batch includes building the dataloader iterator: count it as data wait.
        self._last_batch_end = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._pending_rng is not None:
            _set_rng_states(self._pending_rng)
            self._pending_rng = None
        if self._last_batch_end is not None:
            # A checkpoint save between two batches blocks the loop too; it is accounted as a stall, not data wait.
            stall = self._strategy._take_unaccounted_stall()
            self._data_wait_s += max(now - self._last_batch_end - stall, 0.0)
        self._batch_start = now

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._batch_start is not None:
            self._productive_s += now - self._batch_start
        self._last_batch_end = now
        self._strategy._advance_sampler()
        if trainer.global_rank != 0:
            return
        log = self._strategy.event_log
        if log is None:
            return
        step = trainer.global_step
        if not self._first_step_written and step > 0:
            self._first_step_written = True
            log.write("first_step", step=step, since_attempt_start_s=time.time() - self._strategy._attempt_start_time)
        every = max(int(trainer.log_every_n_steps or 1), 1)
        if step > 0 and step % every == 0 and step != self._last_progress_step:
            self._last_progress_step = step
            self._write_progress(log, step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log = self._strategy.event_log
        if trainer.global_rank == 0 and log is not None and (self._productive_s or self._data_wait_s):
            self._write_progress(log, trainer.global_step)

    def _write_progress(self, log: Any, step: int) -> None:
        log.write("progress", step=step, productive_s=self._productive_s, data_wait_s=self._data_wait_s)
        self._productive_s = 0.0
        self._data_wait_s = 0.0
