"""Checkpoint and stop: one more committed checkpoint ``preempt-step=<N>``, then exit with a given code.

Used by the preemption handling (after the ranks agreed on a signal) and by ``StragglerMonitor(action=
"checkpoint_and_stop")``. The exit is a :class:`CheckpointedStop`, a ``SystemExit`` raised from inside ``fit``:
Lightning's ``_call_and_handle_interrupt`` runs the strategy's teardown and re-raises it, so the process exits with
the code unless the script catches it. A shared leaf (like :mod:`lightning_ft.events`), so that ``fault/`` and
``monitors/`` both use it without importing each other; it imports nothing of lightning-ft.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lightning.pytorch.callbacks import ModelCheckpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

STOP_REASONS = ("preempted", "stopped")

EXIT_CODE_TEMPFAIL = 75
"""``EX_TEMPFAIL`` (sysexits.h): a temporary failure, to be retried. The exit code of a process that stopped after a
preemption or straggler checkpoint: non-zero, so torchrun restarts the worker group and a scheduler requeues the job."""


class CheckpointedStop(SystemExit):
    """``SystemExit(exit_code)`` after a committed ``preempt-step=<N>`` checkpoint.

    Attributes:
        reason: ``"preempted"`` (a preemption signal) or ``"stopped"`` (a monitor's decision, e.g. a straggler).
        checkpoint_path: the committed checkpoint.
    """

    def __init__(self, exit_code: int, *, reason: str, checkpoint_path: Path) -> None:
        super().__init__(exit_code)
        self.reason = reason
        self.checkpoint_path = checkpoint_path


class NodeStop(SystemExit):
    """``SystemExit(exit_code)`` before training starts, without a checkpoint: a node refused to join (its health
    record is in its cooldown), and the other ranks exit so that torchrun forms the world without it.

    Attributes:
        detail: one line, recorded in ``attempt_end``.
    """

    def __init__(self, exit_code: int, *, detail: str) -> None:
        super().__init__(exit_code)
        self.detail = detail


def checkpoint_dir(trainer: pl.Trainer) -> Path:
    """The ``ModelCheckpoint`` ``dirpath`` (``<default_root_dir>/checkpoints`` without one)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def preempt_checkpoint_path(trainer: pl.Trainer) -> Path:
    """``<dirpath>/preempt-step=<global step>``: an ordinary checkpoint to retention and auto-resume."""
    return checkpoint_dir(trainer) / f"preempt-step={trainer.global_step}"


def checkpoint_and_stop(
    trainer: pl.Trainer,
    *,
    exit_code: int,
    reason: str,
    on_committed: Callable[[Path], None] | None = None,
) -> NoReturn:
    """Commit ``preempt-step=<N>`` and raise :class:`CheckpointedStop`.

    Collective: every rank calls it at the same point (a step boundary). The save waits for the checkpoint in flight
    first (the background writer keeps one at a time), then this waits until the new one is committed on every rank.
    ``on_committed(path)`` runs on every rank after the commit and before the exit (events, a scheduler requeue).

    Raises:
        CheckpointedStop: always, once the checkpoint is committed.
        Exception: whatever the save raised (a background write failure), instead.
    """
    if reason not in STOP_REASONS:
        raise ValueError(f"checkpoint_and_stop(reason={reason!r}): must be one of {STOP_REASONS}")
    path = preempt_checkpoint_path(trainer)
    if trainer.is_global_zero:
        log.warning("lightning-ft: %s; saving %s and exiting with code %d", reason, path, exit_code)
    trainer.save_checkpoint(os.fspath(path))
    wait = getattr(trainer.strategy, "checkpoint_wait", None)
    if callable(wait):
        wait()
    trainer.strategy.barrier("lightning_ft_checkpoint_and_stop")
    if on_committed is not None:
        on_committed(path)
    raise CheckpointedStop(exit_code, reason=reason, checkpoint_path=path)


def attempt_end_fields(exception: BaseException | None) -> dict[str, Any]:
    """The fields of ``attempt_end`` for an attempt that ended with ``exception`` (``None``: ``fit`` returned).

    ``reason`` is ``finished``, ``preempted`` or ``stopped`` (a :class:`CheckpointedStop`, or a :class:`NodeStop`
    before training), or ``crashed`` (any other
    exception, named in ``error``). ``exit_code`` is the code the process will exit with, where this process knows it.
    A hang (``hung``) is recorded by the watchdog itself, and a killed process records nothing.
    """
    if exception is None:
        return {"reason": "finished", "exit_code": 0}
    if isinstance(exception, CheckpointedStop):
        return {
            "reason": exception.reason,
            "exit_code": exception.code,
            "checkpoint_path": str(exception.checkpoint_path),
        }
    if isinstance(exception, NodeStop):
        return {"reason": "stopped", "exit_code": exception.code, "detail": exception.detail}
    code = exception.code if isinstance(exception, SystemExit) and isinstance(exception.code, int) else None
    return {"reason": "crashed", "exit_code": code, "error": f"{type(exception).__name__}: {exception}"[:1000]}
