"""Loggers' ``after_save_checkpoint`` under asynchronous saves: called once the checkpoint it announces is committed.

Lightning's ``ModelCheckpoint`` calls ``logger.after_save_checkpoint(callback)`` on rank 0 right after its save call.
Loggers that upload checkpoints (``WandbLogger``, ``MLFlowLogger``, ``NeptuneLogger`` with ``log_model="all"``) then
list the callback's paths with Lightning's ``_scan_checkpoints``, which keeps the paths that are files. Under a
synchronous save the file is complete by then; under ``ElasticFT3D`` it is still being written (its name is held by a
placeholder, which must never be uploaded). :class:`DeferredLoggerCalls` replaces each logger's
``after_save_checkpoint`` (one :class:`~lightning_ft._compat.Patch` per logger, undone at teardown): a call made while
a save is in flight is kept, in order, and made on the training thread as soon as nothing is in flight any more, at
the next point the strategy looks (the next training batch, the next save call, teardown after the last save was
waited for). A call made when nothing is in flight goes straight through. So every call sees every checkpoint that
was committed when it was made as a complete file, and no placeholder: nothing is in flight when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning_ft import _compat

__all__ = ["DeferredLoggerCalls"]


class DeferredLoggerCalls:
    """Defers loggers' ``after_save_checkpoint`` while a checkpoint save is in flight. Training thread only.

    Args:
        busy: whether a save is queued or being written (a non-blocking look).

    Example::

        calls = DeferredLoggerCalls(busy=lambda: writer.busy)
        calls.install(trainer.loggers)
        ...  # ModelCheckpoint saves; its logger calls wait for the commit
        calls.replay()  # at the next batch: the calls whose checkpoints are committed are made now
        calls.uninstall()  # teardown, after the last save was waited for and replay() ran
    """

    def __init__(self, *, busy: Callable[[], bool]) -> None:
        self._busy = busy
        self._patches: list[_compat.Patch] = []
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    @property
    def pending(self) -> int:
        """Calls kept for later."""
        return len(self._pending)

    def install(self, loggers: Iterable[Any]) -> None:
        """Patch ``after_save_checkpoint`` of each of ``loggers`` (again after :meth:`uninstall`)."""
        self.uninstall()
        for logger in loggers:
            original = logger.after_save_checkpoint

            def after_save_checkpoint(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> None:
                if self._pending or self._busy():
                    self._pending.append((_original, args, kwargs))  # after the earlier ones: their order is kept
                    return
                _original(*args, **kwargs)

            self._patches.append(
                _compat.Patch(
                    logger, "after_save_checkpoint", after_save_checkpoint, name="lightning-ft deferred logger call"
                ).install()
            )

    def replay(self) -> None:
        """Make the kept calls, in order, if no save is in flight now; otherwise keep them. An error of a logger is
        raised (the calls after it stay kept)."""
        while self._pending and not self._busy():
            call, args, kwargs = self._pending.pop(0)
            call(*args, **kwargs)

    def uninstall(self) -> None:
        """Undo the patches (idempotent). Calls still kept stay kept for :meth:`replay`."""
        patches, self._patches = self._patches, []
        for patch in patches:
            patch.undo()

    def drop(self) -> None:
        """Forget the kept calls (a run that failed: their saves may never have committed)."""
        self._pending.clear()
