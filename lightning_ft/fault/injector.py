"""``FaultInjector``: real faults at chosen ranks and steps, for tests, demos and fire drills.

A Lightning callback with a fluent interface (like torchft's ``FailureInjector``)::

    injector = (
        FaultInjector()
        .signal_at(rank=1, step=5)                        # SIGTERM at rank 1 while step 5 runs
        .kill_at(rank=0, step=12, during="write")         # SIGKILL in the middle of a checkpoint write
        .hang_at(rank=1, step=20, where="data")           # a data read that never returns
        .storage_error_at(rank=0, step=30, errno=errno.ENOSPC)
        .slow_network(rank=2, ms=50, from_step=40)        # every collective and send of rank 2 50 ms late
    )
    trainer = L.Trainer(strategy=ElasticFT3D(), callbacks=[injector, ...])
    data = DataLoader(injector.wrap_dataset(dataset), ...)   # only for where="data"

Every fault is real, and recorded first as a ``fault_injected`` event (``kind`` and the fault's options) in the
event log of the rank it hits: signals are delivered with ``os.kill``, a hang sleeps, a storage fault raises ``OSError`` from
the checkpoint storage seam (after taking part in the collective write, as a real disk error does), a slow network
delays every collective and send the rank makes through torch.distributed's Python API. A fault fires once,
on attempt ``attempt`` of the run only (0 by default, so the resumed run trains through; ``None`` on every attempt),
at ``rank`` (``None``: every rank). ``step`` is ``trainer.global_step`` when the fault fires, i.e. the number of steps
completed; for storage faults, the step in the checkpoint's folder name (``step=<N>``, as Lightning's default file
name and ``preempt-step=<N>`` have it).

Storage faults reach the writer through :func:`checkpoint_storage`, which ``ElasticFT3D`` asks for its storage at
set-up. :meth:`FaultInjector.from_spec` builds an injector from a string (command lines, environment variables).
"""

from __future__ import annotations

import errno as errno_
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.events import EventLog, get_event_log
from lightning_ft.fault.collective_waits import COLLECTIVES

if TYPE_CHECKING:
    import lightning.pytorch as pl

_STEP_IN_NAME = re.compile(r"step=(\d+)")
_SIGNAL_WHEN = ("step", "validation", "write")


class InjectedFault(RuntimeError):
    """The exception :meth:`FaultInjector.fail_at` raises."""


@dataclass
class _Fault:
    kind: str
    rank: int | None
    step: int | None
    attempt: int | None
    params: dict[str, Any] = field(default_factory=dict)
    fired: bool = False


def _signal(value: Any) -> signal.Signals:
    if isinstance(value, str):
        name = value.upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    return signal.Signals(value)


def _errno(value: Any) -> int:
    return int(getattr(errno_, value)) if isinstance(value, str) else int(value)


class FaultInjector(Callback):
    """Injects real faults at chosen ranks, steps and attempts; see the module docstring.

    Each method adds one fault and returns the injector. Contract: every fault fires at most once per process, at the
    first hook that matches; ``slow_rank`` acts at every step from ``from_step`` on.

    Raises:
        ValueError: a rank, step or option out of range (when the fault is added); ``hang_at(where="data")`` without
            :meth:`wrap_dataset` (when training starts).
    """

    def __init__(self) -> None:
        self.faults: list[_Fault] = []
        self._rank = 0
        self._attempt = 0
        self._step = 0
        self._dataset_wrapped = False
        self._log: EventLog | None = None
        self._network_patches: list[_compat.Patch] = []

    @property
    @override
    def state_key(self) -> str:
        return "lightning_ft.FaultInjector"

    # ------------------------------------------------------------------ building

    def _add(self, kind: str, rank: int | None, step: int | None, attempt: int | None, **params: Any) -> FaultInjector:
        for name, value in (("rank", rank), ("step", step), ("attempt", attempt)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"FaultInjector.{kind}({name}={value!r}): must be a non-negative int or None")
        self.faults.append(_Fault(kind, rank, step, attempt, params))
        return self

    def fail_at(self, *, rank: int | None, step: int, attempt: int | None = 0) -> FaultInjector:
        """Raise :class:`InjectedFault` at the end of step ``step`` (a crash: an exception in the training loop)."""
        return self._add("fail_at", rank, step, attempt)

    def signal_at(
        self,
        *,
        rank: int | None,
        step: int,
        sig: signal.Signals | str | int = signal.SIGTERM,
        during: str = "step",
        times: int = 1,
        attempt: int | None = 0,
    ) -> FaultInjector:
        """Deliver ``sig`` ``times`` times: while step ``step`` runs (``during="step"``), in the first validation batch
        at or after it (``"validation"``), or when the write of the checkpoint of step ``step`` starts
        (``"write"``)."""
        if during not in _SIGNAL_WHEN:
            raise ValueError(f"FaultInjector.signal_at(during={during!r}): must be one of {_SIGNAL_WHEN}")
        if times < 1:
            raise ValueError(f"FaultInjector.signal_at(times={times!r}): must be >= 1")
        return self._add("signal_at", rank, step, attempt, sig=_signal(sig), during=during, times=times)

    def kill_at(
        self, *, rank: int | None, step: int, during: str = "step", delay_s: float = 0.0, attempt: int | None = 0
    ) -> FaultInjector:
        """SIGKILL (nothing runs after it): while step ``step`` runs, or ``delay_s`` seconds into the write of the
        checkpoint of step ``step`` (``during="write"``)."""
        if during not in ("step", "write"):
            raise ValueError(f"FaultInjector.kill_at(during={during!r}): must be 'step' or 'write'")
        return self._add("kill_at", rank, step, attempt, during=during, delay_s=float(delay_s))

    def hang_at(
        self,
        *,
        rank: int | None,
        step: int,
        where: str = "data",
        seconds: float = float("inf"),
        attempt: int | None = 0,
    ) -> FaultInjector:
        """Stop the rank for ``seconds`` (for ever by default) while alive: in the data read of the batch after step
        ``step`` (``where="data"``, needs :meth:`wrap_dataset`), or at the start of step ``step`` (``"step"``)."""
        if where not in ("data", "step"):
            raise ValueError(f"FaultInjector.hang_at(where={where!r}): must be 'data' or 'step'")
        return self._add("hang_at", rank, step, attempt, where=where, seconds=float(seconds))

    def slow_rank(
        self, *, rank: int | None, ms: float, from_step: int = 0, attempt: int | None = None
    ) -> FaultInjector:
        """Add ``ms`` milliseconds to every step of ``rank`` from ``from_step`` on (a straggler)."""
        if ms < 0:
            raise ValueError(f"FaultInjector.slow_rank(ms={ms!r}): must be >= 0")
        return self._add("slow_rank", rank, from_step, attempt, ms=float(ms))

    def slow_network(
        self, *, rank: int | None, ms: float, from_step: int = 0, attempt: int | None = 0
    ) -> FaultInjector:
        """Delay by ``ms`` milliseconds every collective and every ``send`` that ``rank`` makes through
        ``torch.distributed``'s Python API (``torch.distributed.all_reduce``, ``barrier``, ``send``, ...), from the
        start of step ``from_step`` until ``fit`` ends: a slow link out of the rank. A ``recv`` is not delayed (the
        sender's delay reaches it); DDP's gradient all-reduce, which runs in C++ inside backward, is not slowed."""
        if ms < 0:
            raise ValueError(f"FaultInjector.slow_network(ms={ms!r}): must be >= 0")
        return self._add("slow_network", rank, from_step, attempt, ms=float(ms))

    def storage_error_at(
        self, *, rank: int | None, step: int | None, errno: int | str = errno_.ENOSPC, attempt: int | None = 0
    ) -> FaultInjector:
        """Make the write of the checkpoint of step ``step`` (``None``: the next one) fail with ``OSError(errno)``
        (``ENOSPC``: disk full, ``EIO``: I/O error) on ``rank``."""
        return self._add("storage_error_at", rank, step, attempt, errno=_errno(errno))

    def storage_stall_at(
        self, *, rank: int | None, step: int | None, seconds: float, attempt: int | None = 0
    ) -> FaultInjector:
        """Make the write of the checkpoint of step ``step`` (``None``: the next one) stall ``seconds`` on ``rank``."""
        return self._add("storage_stall_at", rank, step, attempt, seconds=float(seconds))

    @classmethod
    def from_spec(cls, spec: str) -> FaultInjector:
        """Build from ``"method:key=value,...;method:..."``, e.g. ``"signal_at:rank=1,step=3,sig=SIGUSR1"``.

        Values are ints, floats, ``None`` or words (signal and errno names). An empty spec gives an empty injector.
        """
        injector = cls()
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            method, _, args = part.partition(":")
            if method not in _SPEC_METHODS:
                raise ValueError(f"FaultInjector.from_spec({spec!r}): unknown fault {method!r}; use {_SPEC_METHODS}")
            kwargs = {}
            for item in filter(None, (a.strip() for a in args.split(","))):
                key, _, raw = item.partition("=")
                kwargs[key.strip()] = _parse_value(raw.strip())
            getattr(injector, method)(**kwargs)
        return injector

    # ------------------------------------------------------------------ seams

    def wrap_dataset(self, dataset: Dataset) -> Dataset:
        """``dataset`` with the data-read faults of ``hang_at(where="data")`` (map-style, read in the main process)."""
        self._dataset_wrapped = True
        return _FaultyDataset(dataset, self)

    def wrap_storage(self, storage: Any) -> Any:
        """The checkpoint storage seam ``storage`` with this injector's storage faults (see :func:`checkpoint_storage`)."""
        return FaultyStorage(storage, self)

    @property
    def has_storage_faults(self) -> bool:
        kinds = {"storage_error_at", "storage_stall_at"}
        return any(f.kind in kinds or f.params.get("during") == "write" for f in self.faults)

    # ------------------------------------------------------------------ firing

    def _due(self, kind: str, *, step: int | None = None, exact: bool = True, **match: Any) -> list[_Fault]:
        due = []
        for fault in self.faults:
            if fault.kind != kind or fault.fired:
                continue
            if fault.rank is not None and fault.rank != self._rank:
                continue
            if fault.attempt is not None and fault.attempt != self._attempt:
                continue
            if any(fault.params.get(k) != v for k, v in match.items()):
                continue
            if fault.step is not None and step is not None and (fault.step != step if exact else step < fault.step):
                continue
            due.append(fault)
        return due

    def _record(self, fault: _Fault) -> None:
        """A ``fault_injected`` event before the fault acts: the fault's time, for restart-time measurements."""
        fault.fired = True
        if self._log is not None:
            params = {k: (v.name if isinstance(v, signal.Signals) else v) for k, v in fault.params.items()}
            self._log.write("fault_injected", step=self._step, kind=fault.kind, **params)

    def _fire(self, fault: _Fault) -> None:
        self._record(fault)
        where = f"rank {self._rank}, step {self._step}, attempt {self._attempt}"
        params = fault.params
        if fault.kind == "signal_at":
            print(f"[fault] {params['sig'].name} x{params['times']} ({params['during']}) at {where}", flush=True)
            for _ in range(params["times"]):
                os.kill(os.getpid(), params["sig"])
        elif fault.kind == "kill_at":
            print(f"[fault] SIGKILL ({params['during']}) at {where}", flush=True)
            if params["delay_s"] > 0:
                threading.Timer(params["delay_s"], os.kill, (os.getpid(), signal.SIGKILL)).start()
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang_at":
            print(f"[fault] hang ({params['where']}) for {params['seconds']} s at {where}", flush=True)
            _sleep(params["seconds"])
        elif fault.kind == "fail_at":
            print(f"[fault] exception at {where}", flush=True)
            raise InjectedFault(f"injected failure at {where}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rank = trainer.global_rank
        self._log = log = get_event_log(trainer, open_if_missing=False)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._attempt = log.attempt if log is not None else int(restart) if restart.isdigit() else 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        if self._due("hang_at", where="data") and not self._dataset_wrapped:
            raise ValueError("FaultInjector.hang_at(where='data'): wrap the training dataset with wrap_dataset()")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._step = step = trainer.global_step
        for fault in self._due("slow_rank", step=step, exact=False):
            time.sleep(fault.params["ms"] / 1000.0)
        for fault in self._due("slow_network", step=step, exact=False):
            self._record(fault)
            print(f"[fault] network {fault.params['ms']} ms slower at rank {self._rank}, step {step}", flush=True)
            self._slow_network(fault.params["ms"] / 1000.0)
        for kind, match in (("signal_at", {"during": "step"}), ("kill_at", {"during": "step"}), ("hang_at", {})):
            for fault in self._due(kind, step=step, **match):
                if kind != "hang_at" or fault.params["where"] == "step":
                    self._fire(fault)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step
        for fault in self._due("fail_at", step=trainer.global_step):
            self._fire(fault)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        for fault in self._due("signal_at", step=trainer.global_step, exact=False, during="validation"):
            self._fire(fault)

    def _slow_network(self, delay_s: float) -> None:
        def slowed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def late(*args: Any, **kwargs: Any) -> Any:
                time.sleep(delay_s)
                return fn(*args, **kwargs)

            return late

        for name in (*(c for c in COLLECTIVES if c != "recv"), "isend"):
            fn = getattr(dist, name, None)
            if fn is not None:
                patch = _compat.Patch(dist, name, slowed(fn), name=f"FaultInjector.slow_network: {name}")
                self._network_patches.append(patch.install())

    def _restore_network(self) -> None:
        # Before the strategy's teardown undoes its own patches of the same functions (last installed, first undone).
        for patch in reversed(self._network_patches):
            patch.undo()
        self._network_patches = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_network()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_network()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_network()

    def _on_data_read(self) -> None:
        # Runs inside the dataloader's fetch, which Lightning does one batch ahead: at step s it reads batch s + 1.
        for fault in self._due("hang_at", step=self._step, where="data"):
            self._fire(fault)

    def _on_storage_write(self, path: Any) -> Callable[[], None]:
        """Faults due at the start of a checkpoint write; returns what to do after the real write (raise, or not)."""
        # The innermost name that says a step: an object-store save writes into a generation inside its checkpoint.
        names = [_STEP_IN_NAME.search(name) for name in reversed(os.fspath(path).split("/")[-2:])]
        match = next((m for m in names if m), None)
        step = int(match.group(1)) if match else None
        after: list[Callable[[], None]] = []
        # Signals and kills first: a stall after them keeps the write in flight while the signal is handled.
        for kind in ("signal_at", "kill_at"):
            for fault in self._due(kind, step=step, during="write"):
                self._fire(fault)
        for fault in self._due("storage_stall_at", step=step):
            self._record(fault)
            print(f"[fault] storage stall {fault.params['seconds']} s at rank {self._rank} ({path})", flush=True)
            time.sleep(fault.params["seconds"])
        for fault in self._due("storage_error_at", step=step):
            self._record(fault)
            code = fault.params["errno"]
            print(f"[fault] storage error {errno_.errorcode.get(code, code)} at rank {self._rank} ({path})", flush=True)

            def fail(code: int = code) -> None:
                raise OSError(code, f"{os.strerror(code)} (injected by FaultInjector)", os.fspath(path))

            after.append(fail)

        def finish() -> None:
            for action in after:
                action()

        return finish


_SPEC_METHODS = (
    "fail_at",
    "signal_at",
    "kill_at",
    "hang_at",
    "slow_rank",
    "slow_network",
    "storage_error_at",
    "storage_stall_at",
)


def _parse_value(raw: str) -> Any:
    if raw in ("None", "none", ""):
        return None
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw


def _sleep(seconds: float) -> None:
    # A live rank that does not progress: it sleeps in slices, so signals keep being handled as in a real stuck read.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(1.0, deadline - time.monotonic()))


class FaultyStorage:
    """The checkpoint storage seam with a :class:`FaultInjector`'s storage faults; everything else is delegated.

    A failing rank still takes part in the collective write and raises afterwards, so the other ranks are not left
    waiting in it (as a real disk error behaves in the storage seam).
    """

    def __init__(self, inner: Any, injector: FaultInjector) -> None:
        self.inner = inner
        self.injector = injector

    def write(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        finish = self.injector._on_storage_write(path)
        result = self.inner.write(path, *args, **kwargs)
        finish()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FaultyDataset(Dataset):
    def __init__(self, dataset: Dataset, injector: FaultInjector) -> None:
        self.dataset = dataset
        self.injector = injector

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.injector._on_data_read()
        return self.dataset[index]


def checkpoint_storage(trainer: pl.Trainer) -> Any:
    """The storage the checkpoint writer of ``trainer`` should use: ``SnapshotStorage`` wrapped by every
    :class:`FaultInjector` among the callbacks that has storage faults, or ``None`` (the writer's default)."""
    injectors = [cb for cb in trainer.callbacks if isinstance(cb, FaultInjector) and cb.has_storage_faults]
    if not injectors:
        return None
    from lightning_ft.checkpoint.internal import SnapshotStorage

    storage: Any = SnapshotStorage()
    for injector in injectors:
        storage = injector.wrap_storage(storage)
    return storage
