"""Loggers' ``after_save_checkpoint`` under asynchronous saves: made once the checkpoint it announces is committed, and
seeing what it sees under a synchronous save.

Lightning's ``ModelCheckpoint`` calls ``logger.after_save_checkpoint(callback)`` on rank 0 right after its save call.
Loggers that upload checkpoints (``WandbLogger``, ``MLFlowLogger``, ``NeptuneLogger`` with ``log_model="all"``) then
list the callback's paths with Lightning's ``_scan_checkpoints``: its ``best_model_path``, ``last_model_path`` and
``best_k_models``, kept where the path is a file, uploaded where its modification time is new. Under a synchronous save
the file is complete by then; under ``ElasticFT3D`` it is still being written (its name is held by a placeholder,
which must never be uploaded).

:class:`DeferredLoggerCalls` replaces each such logger's ``after_save_checkpoint`` (one
:class:`~lightning_ft._compat.Patch` per logger, undone at teardown). A call made while a save is in flight is kept,
in order, with a copy of the callback's attributes as they were at the call, and made on the training thread as soon
as nothing is in flight any more, at the next point the strategy looks (the next training batch, the next save call,
teardown after the last save was waited for), with those attributes put back on the callback for the length of the
call. So the call sees the callback as it was at the call and every checkpoint it names complete. Before anything
changes a path a kept call names (a later save to it, such as ``last.ckpt``; its removal by ``save_top_k``), the
strategy waits for the save in flight and makes the call (:meth:`DeferredLoggerCalls.settle`), so the call sees the
file a synchronous save would have shown it. Lightning moves a ``save_last="link"`` link itself, right after the call,
with no strategy call in between: a call from such a callback waits for the save in flight there and then.

What it costs: nothing while saves commit before the next one starts. The loop waits for the save in flight where a
later save would overwrite or remove a path a kept call names (``save_last=True``: the ``last`` save waits for the
top-k save of the same step) and at every call of a ``save_last="link"`` callback, as it waits for a synchronous save.
Loggers whose ``after_save_checkpoint`` does nothing (Lightning's ``Logger`` and ``TensorBoardLogger``) are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from lightning_ft import _compat

__all__ = ["DeferredLoggerCalls"]

_SCANNED = ("best_model_path", "last_model_path")
"""The callback's attributes that Lightning's ``_scan_checkpoints`` reads paths from (besides ``best_k_models``)."""


def _does_nothing(method: Any) -> bool:
    """Whether ``method``'s body only returns ``None`` (``pass`` under a docstring), as Lightning's base ``Logger`` and
    ``TensorBoardLogger`` define ``after_save_checkpoint``."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    return code is not None and code.co_code == _NOTHING.co_code and not code.co_names


def _nothing(self: Any, checkpoint_callback: Any) -> None:
    """A docstring, as the loggers' own no-op methods have."""


_NOTHING = _nothing.__code__


def _key(path: Any) -> str | None:
    """A path as it is compared with a save's path: absolute where it is local; URLs as they are."""
    if not path:
        return None
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


class _Call:
    """One kept ``after_save_checkpoint`` call and the callback's attributes at the time it was made."""

    def __init__(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs
        callback = args[0] if args else kwargs.get("checkpoint_callback")
        self.callback = callback
        self.attributes: dict[str, Any] | None = None
        try:
            # A copy one level deep: ModelCheckpoint changes its dicts in place (best_k_models) and replaces the rest.
            self.attributes = {k: _shallow_copy(v) for k, v in vars(callback).items()}
        except (TypeError, ReferenceError):  # no instance dict (slots), or a callback already collected
            self.attributes = None
        self.paths = self._named_paths()

    def _named_paths(self) -> set[str]:
        attributes = self.attributes or {}
        named = [attributes.get(name) for name in _SCANNED]
        best_k = attributes.get("best_k_models")
        if isinstance(best_k, dict):
            named.extend(best_k)
        return {key for key in map(_key, named) if key is not None}

    def make(self) -> None:
        """Make the call with the callback's attributes as they were when it was kept; its own are put back after."""
        live: dict[str, Any] | None = None
        if self.attributes is not None:
            try:
                own = vars(self.callback)
                live = dict(own)
                own.clear()
                own.update(self.attributes)
            except (TypeError, ReferenceError):
                live = None
        try:
            self.method(*self.args, **self.kwargs)
        finally:
            if live is not None:
                own = vars(self.callback)
                own.clear()
                own.update(live)


def _shallow_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return type(value)(value) if type(value) is dict else value.copy()
    if isinstance(value, (list, set)):
        return value.copy()
    return value


class DeferredLoggerCalls:
    """Defers loggers' ``after_save_checkpoint`` while a checkpoint save is in flight. Training thread of rank 0 (the
    only rank Lightning calls loggers on); nothing here is collective.

    Args:
        busy: whether a save is queued or being written (a non-blocking look).
        wait: blocks until no save is in flight (local: the background writer's threads, no collective).

    Example::

        calls = DeferredLoggerCalls(busy=lambda: writer.busy, wait=writer.wait)
        calls.install(trainer.loggers)
        ...  # ModelCheckpoint saves; its logger calls wait for the commit
        calls.settle(path)  # before a save to or a removal of `path`: the calls that name it are made first
        calls.replay()  # at the next batch: the calls whose checkpoints are committed are made now
        calls.uninstall()  # teardown, after the last save was waited for and replay() ran
    """

    def __init__(self, *, busy: Callable[[], bool], wait: Callable[[], None] = lambda: None) -> None:
        self._busy = busy
        self._wait = wait
        self._patches: list[_compat.Patch] = []
        self._pending: list[_Call] = []

    @property
    def pending(self) -> int:
        """Calls kept for later."""
        return len(self._pending)

    def install(self, loggers: Iterable[Any]) -> None:
        """Patch ``after_save_checkpoint`` of each of ``loggers`` that does something (again after :meth:`uninstall`)."""
        self.uninstall()
        for logger in loggers:
            original = logger.after_save_checkpoint
            if _does_nothing(original):
                continue

            def after_save_checkpoint(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> None:
                if not self._pending and not self._busy():
                    _original(*args, **kwargs)
                    return
                call = _Call(_original, args, kwargs)
                if (call.attributes or {}).get("save_last") == "link":
                    # Lightning repoints `last` right after this call: the call must see the link where it is now.
                    self._wait()
                    self.replay()
                    _original(*args, **kwargs)
                    return
                self._pending.append(call)  # after the earlier ones: their order is kept

            self._patches.append(
                _compat.Patch(
                    logger, "after_save_checkpoint", after_save_checkpoint, name="lightning-ft deferred logger call"
                ).install()
            )

    def names(self, path: Any) -> bool:
        """Whether a kept call names ``path`` (a path Lightning's scan would read for it)."""
        key = _key(path)
        return key is not None and any(key in call.paths for call in self._pending)

    def settle(self, path: Any) -> None:
        """Before ``path`` changes (a save to it, its removal): if a kept call names it, wait for the save in flight
        and make the kept calls (blocking)."""
        if self.names(path):
            self._wait()
            self.replay()

    def replay(self) -> None:
        """Make the kept calls, in order, if no save is in flight now; otherwise keep them. An error of a logger is
        raised (the calls after it stay kept)."""
        while self._pending and not self._busy():
            self._pending.pop(0).make()

    def uninstall(self) -> None:
        """Undo the patches (idempotent). Calls still kept stay kept for :meth:`replay`."""
        patches, self._patches = self._patches, []
        for patch in patches:
            patch.undo()

    def drop(self) -> None:
        """Forget the kept calls (a run that failed: their saves may never have committed)."""
        self._pending.clear()
