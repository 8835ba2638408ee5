"""Overlapping the capture of a save with the next training step, without ever saving a mixed state.

Parameters and optimizer state change only in ``optimizer.step()``. So a save does not need to copy them before
``save()`` returns: it may copy them in the background while the next forward and backward run, as long as the next
optimizer step waits for that copy. :class:`CaptureGuard` is that wait: it holds the modules and optimizers it watches,
installs a step pre-hook on each optimizer (``Optimizer.register_step_pre_hook``, torch's public API) that blocks
until the capture in flight has copied everything, and tells the stager which tensors it guards (the storages of the
watched modules' parameters and of the watched optimizers' state).

Everything else is copied at the save call, before ``save()`` returns: buffers (BatchNorm statistics change in every
forward), per-rank state, CUDA tensors, DTensors, and any tensor the guard does not know. A write to a guarded tensor that does
not go through ``optimizer.step()`` (a callback or user code writing weights between the save call and the next step)
is caught by the tensors' version counters: each deferred tensor's counter is read at the save call and again after
its copy, and a difference fails the save with :class:`CaptureRaceError` instead of committing a mixed state. Writes
through ``tensor.data`` bypass version counters (torch gives ``.data`` a counter of its own) and are not caught.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from lightning_ft import _compat
from lightning_ft.checkpoint.errors import CheckpointError

__all__ = ["CaptureGuard", "CaptureRaceError", "check_unchanged", "storage_key"]


class CaptureRaceError(CheckpointError):
    """A tensor was written between the save call and its background copy; the save is not committed."""


def storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of the CPU memory a tensor lives in: the same for a parameter, its ``detach()`` and its views.
    ``None`` for what is never deferred: DTensors (FSDP2 and tensor parallelism manage their shards' memory
    themselves), CUDA, sparse and storage-less tensors."""
    if isinstance(tensor, _compat.DTensor):
        return None
    if tensor.is_cuda or tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # a tensor subclass or layout without a storage
        return None


def check_unchanged(key: str, tensor: torch.Tensor, version: int) -> None:
    """Raise :class:`CaptureRaceError` if ``tensor`` was written in place since its version counter read ``version``."""
    now = _compat.tensor_version(tensor)
    if now != version:
        raise CaptureRaceError(
            f"{key} was written in place after the save call and before its background copy (version {version} ->"
            f" {now}), so the checkpoint would mix two states; it is not committed. Write weights in optimizer.step()"
            " or before the save (a callback's on_train_batch_end runs before ModelCheckpoint's if it is listed"
            " first), or call the checkpointer's wait() before writing."
        )


class CaptureGuard:
    """Makes the watched optimizers' next step wait for the capture in flight, and names the tensors it guards.

    The owner calls :meth:`watch` before each save with the modules and optimizers of the run (new ones get a hook;
    the hook of an optimizer no longer watched stays until :meth:`close`, and waits only while a capture is in flight).
    The checkpointer calls :meth:`begin` in ``save()``, :meth:`end` once the background copy is done (also when it
    failed), and the hooks call :meth:`wait`. Thread-safe.

    Example::

        guard = CaptureGuard()
        checkpointer = AsyncCheckpointer(capture_guard=guard)
        guard.watch(modules=[model], optimizers=[optimizer])
        checkpointer.save("ckpt/step=10", {"model": model.state_dict(), "optim": optimizer.state_dict()})
        loss = model(x).sum()
        loss.backward()  # overlaps with the copy of the weights
        optimizer.step()  # waits for the copy first
        guard.close()
    """

    def __init__(self) -> None:
        self._modules: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._handles: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        self._idle = threading.Event()
        self._idle.set()
        self._waited_s = 0.0

    def watch(self, *, modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Guard these modules' parameters and these optimizers' state from now on; hooks each new optimizer."""
        self._modules = [weakref.ref(m) for m in modules if m is not None]
        self._optimizers = []
        for optimizer in optimizers:
            self._optimizers.append(weakref.ref(optimizer))
            if optimizer not in self._handles:
                self._handles[optimizer] = optimizer.register_step_pre_hook(self._before_step)

    def guarded_storages(self) -> set[int]:
        """:func:`storage_key` of every tensor only ``optimizer.step()`` of a watched optimizer writes: the watched
        modules' parameters and the watched optimizers' state tensors (CPU only: CUDA tensors are copied at the call)."""
        tensors: list[torch.Tensor] = []
        for ref in self._modules:
            module = ref()
            if module is not None:
                tensors += module.parameters()
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is not None:
                for state in optimizer.state.values():
                    tensors += (value for value in state.values() if isinstance(value, torch.Tensor))
        keys = {storage_key(tensor) for tensor in tensors}
        keys.discard(None)
        return keys  # type: ignore[return-value]

    def begin(self) -> None:
        """A capture with deferred copies starts: the watched optimizers' next step waits for :meth:`end`."""
        self._idle.clear()

    def end(self) -> None:
        """The deferred copies are done (or failed): the optimizers may step."""
        self._idle.set()

    def wait(self) -> None:
        """Block until no capture is in flight."""
        self._idle.wait()

    def take_waited_s(self) -> float:
        """Seconds optimizer steps waited for deferred copies since the previous call (a stall of the loop)."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._idle.is_set():
            start = time.perf_counter()
            self._idle.wait()
            self._waited_s += time.perf_counter() - start

    def close(self) -> None:
        """Remove the hooks; a step no longer waits. Idempotent."""
        self._idle.set()
        for handle in list(self._handles.values()):
            handle.remove()
        self._handles = weakref.WeakKeyDictionary()
        self._modules, self._optimizers = [], []
