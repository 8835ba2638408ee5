"""Teardown that is safe at every stage of a failed set-up and never hides the error that stopped the run.

Lightning calls ``Strategy.teardown`` at the end of a run and also while it handles an exception raised anywhere
between the launcher and the last step. At that point any part of the set-up may be missing: the module may not be
attached to the trainer yet (a launch that failed), the event log, the checkpoint writer or the tracker may not
exist. An error raised from teardown then would be printed after the user's own error ("During handling of the above
exception, another exception occurred"), look like the cause, and skip the rest of Lightning's teardown (loggers,
signal handlers). :class:`TeardownSteps` runs every step of a teardown whatever happens to the others; while a run
fails, their errors are logged and the run's own exception is the one that propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


def attached_trainer(module: Any) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or ``None`` (no module, or Lightning has not attached it yet)."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # LightningModule.trainer raises until the Trainer attaches itself in `_run`
        return None


def remove_callback(trainer: pl.Trainer | None, callback: Any) -> None:
    """Remove ``callback`` from ``trainer.callbacks`` if both exist and it is there."""
    if trainer is not None and callback is not None and callback in trainer.callbacks:
        trainer.callbacks.remove(callback)


class TeardownSteps:
    """Runs each step of a teardown even when an earlier one failed, then reports the errors once.

    Args:
        failure: the exception the run is failing with (what ``Strategy.on_exception`` received), or ``None`` when
            the run ends normally.

    With ``failure``, :meth:`finish` logs every step's error with its traceback and raises nothing, so ``failure``
    stays the error the user sees last. Without it, :meth:`finish` raises the first error (a failed background save,
    say) and logs the others.

    Example::

        steps = TeardownSteps(failure=self._failure)
        steps.run(writer.close, "waiting for the checkpoint in flight")
        steps.run(patch.undo, "undoing the auto-resume patch")
        steps.finish()
    """

    def __init__(self, *, failure: BaseException | None) -> None:
        self.failure = failure
        self.errors: list[tuple[str, Exception]] = []

    def run(self, step: Callable[[], object], what: str) -> None:
        """Call ``step``; keep an ``Exception`` it raises (``what`` says what it was doing) and carry on."""
        try:
            step()
        except Exception as err:  # noqa: BLE001 - kept and reported by finish(); the other steps still run
            self.errors.append((what, err))

    def finish(self) -> None:
        """Report the errors of the steps: raise the first one, unless the run is already failing (see the class)."""
        if not self.errors:
            return
        if self.failure is not None:
            for what, err in self.errors:
                log.error(
                    "lightning-ft: teardown failed while %s (%s: %s); the error that stopped the run follows",
                    what,
                    type(err).__name__,
                    err,
                    exc_info=err,
                )
            return
        for what, err in self.errors[1:]:
            log.error("lightning-ft: teardown also failed while %s", what, exc_info=err)
        raise self.errors[0][1]
