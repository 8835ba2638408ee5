"""A fleet of ``StragglerMonitor``s in one process, driven step by step with per-rank timings on injected clocks.

Each simulated rank has its own fake trainer and its own clock; the monitors' ``all_gather`` is replaced by a board
that collects every rank's row (``monkeypatch``), so the monitors decide exactly as they would across processes,
with timings the test chooses instead of ``time.sleep`` on a shared machine.

Timing model of one data-parallel step on rank ``r`` (milliseconds): it waits ``data[r]`` for its batch, computes
``forward[r]`` and reaches backward, where the gradient all-reduce finishes once the last rank has computed its own
``backward`` part; then ``optimizer[r]``. Its next step starts right away.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

import lightning_ft.monitors.straggler_monitor as straggler_monitor
from lightning_ft.events import EventLog
from lightning_ft.monitors import StragglerMonitor


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class _Board:
    """The gathers of every rank, in call order; a rank's ``k``-th gather meets every other rank's ``k``-th."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.current = 0
        self.rounds: list[dict[int, list[float]]] = []
        self.calls = [0] * world

    def start_gather_rows(self, row: list[float], device: torch.device) -> _Pending:
        k = self.calls[self.current]
        self.calls[self.current] += 1
        if k == len(self.rounds):
            self.rounds.append({})
        self.rounds[k][self.current] = list(row)
        return _Pending(self, k)


class _Pending:
    def __init__(self, board: _Board, k: int) -> None:
        self.board, self.k = board, k

    def wait(self) -> list[list[float]]:
        rows = self.board.rounds[self.k]
        assert len(rows) == self.board.world, "a rank read a gather that not every rank had joined"
        return [rows[r] for r in range(self.board.world)]


class SimulatedFleet:
    """``world`` monitors (``StragglerMonitor(**kwargs)``, one per rank) trained through ``step()``.

    One fleet at a time: creating one routes every monitor's gather to its board.
    """

    def __init__(self, monkeypatch: Any, root: Any, world: int, *, attempt: int = 0, **kwargs: Any) -> None:
        self.board = _Board(world)
        monkeypatch.setattr(straggler_monitor, "start_gather_rows", self.board.start_gather_rows)
        self.world = world
        self.clocks = [FakeClock() for _ in range(world)]
        self.monitors = [StragglerMonitor(clock=self.clocks[r], **kwargs) for r in range(world)]
        self.trainers = [
            SimpleNamespace(
                global_rank=r,
                local_rank=r,
                is_global_zero=r == 0,
                global_step=0,
                world_size=world,
                loggers=[RecordingLogger()] if r == 0 else [],
                default_root_dir=str(root),
                strategy=SimpleNamespace(
                    root_device=torch.device("cpu"),
                    event_log=EventLog(root, rank=r, run_id="sim", attempt=attempt),
                ),
            )
            for r in range(world)
        ]
        for trainer in self.trainers:
            trainer.strategy.event_log.bind_step(lambda t=trainer: t.global_step)
        self._start_s = [0.0] * world
        for r in self._ranks():
            self.monitors[r].setup(self.trainers[r], None, "fit")

    @property
    def logger(self) -> RecordingLogger:
        return self.trainers[0].loggers[0]

    def _ranks(self):
        for r in range(self.world):
            self.board.current = r
            yield r

    def start(self, global_step: int = 0) -> None:
        """``on_train_start`` (at ``global_step``, as after a resume) and the first epoch's start, on every rank."""
        for r in self._ranks():
            self.trainers[r].global_step = global_step
            self.monitors[r].on_train_start(self.trainers[r], None)
            self.monitors[r].on_train_epoch_start(self.trainers[r], None)

    def step(
        self,
        *,
        forward: Sequence[float] | float = 5.0,
        data: Sequence[float] | float = 1.0,
        backward: Sequence[float] | float = 10.0,
        optimizer: Sequence[float] | float = 1.0,
    ) -> None:
        """One training step on every rank; each argument is one value for all ranks or one per rank (ms)."""
        data, forward, backward, optimizer = (
            [float(v)] * self.world if isinstance(v, (int, float)) else [float(x) for x in v]
            for v in (data, forward, backward, optimizer)
        )
        reach = [self._start_s[r] + (data[r] + forward[r]) / 1000 for r in range(self.world)]
        reduced = max(reach[r] + backward[r] / 1000 for r in range(self.world))
        for r in self._ranks():
            monitor, trainer, clock = self.monitors[r], self.trainers[r], self.clocks[r]
            clock.now_s = self._start_s[r] + data[r] / 1000
            monitor.on_train_batch_start(trainer, None, None, 0)
            clock.now_s = reach[r]
            monitor.on_before_backward(trainer, None, None)
            clock.now_s = reduced
            monitor.on_after_backward(trainer, None)
            trainer.global_step += 1
            clock.now_s = reduced + optimizer[r] / 1000
            self._start_s[r] = clock.now_s
            monitor.on_train_batch_end(trainer, None, None, None, 0)

    def end(self) -> None:
        for r in self._ranks():
            self.monitors[r].on_train_end(self.trainers[r], None)

    def events(self, name: str) -> list[dict]:
        from lightning_ft.events import read_events

        return [e for e in read_events(self.trainers[0].default_root_dir) if e["event"] == name]
