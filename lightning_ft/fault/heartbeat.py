"""Per-rank progress, published to a key-value store, and the rule that names the rank that stopped first.

In synchronous training a rank that stops (a hung data read, a dead NFS mount, a kernel that never returns) stops
every other rank too: they wait for it in the next collective. Step counts alone cannot tell them apart, since all
ranks completed the same steps. So every rank counts *progress points*, the hooks it passes in order (batch start,
before and after backward, batch end, validation batch end), and publishes ``(points, step, last point, its time)``.
A rank waiting in a collective has usually passed more points than the rank it waits for, but not always: when one
rank stops inside a hook in which the others call collectives (a user callback's ``on_train_batch_end`` at a step
where ``ModelCheckpoint`` saves), all ranks have passed the same points. So every rank also says whether its main
thread is inside a collective, and since when (``in_collective_since``): inside one of torch.distributed's blocking
Python collectives (the :class:`~lightning_ft.fault.fault_handler.FaultHandler` wraps them while ``fit`` runs), or
inside a DDP backward, which holds the gradient all-reduce (from the ``before_backward`` point to the next one).

The culprit is the rank that is not waiting in a collective; where several are not waiting, the one with the fewest
points, and among those the one whose last point is oldest. Where every rank waits, the ranks that are ahead wait
for those behind (the fewest points), and among those the one whose collective started first entered a collective
the others never joined. A rank that
no longer publishes at all (dead, or frozen with the interpreter lock held) is named before any of them.

The main thread only updates :class:`Progress` (a few attribute writes per hook); the watchdog thread publishes it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Heartbeat:
    """One rank's progress as published."""

    rank: int
    points: int
    """Progress points passed in this attempt."""
    step: int | None
    """``trainer.global_step`` at the last point."""
    point: str
    """Name of the last point (``"batch_end"``, ``"before_backward"``, ...)."""
    point_time: float
    """Unix time of the last point."""
    alive_time: float
    """Unix time of publication (the watchdog thread was alive then)."""
    in_collective_since: float | None = None
    """Unix time at which the main thread entered the collective it is waiting in; ``None`` when it is in none."""
    collective: str | None = None
    """Which: a torch.distributed function name (``"all_gather_object"``) or ``"ddp_backward"``; ``None`` when none."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        return cls(**json.loads(raw))


class Progress:
    """What the training loop tells the watchdog. Written by the main thread, read by the watchdog thread.

    Args:
        clock: Unix time source (tests inject one).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.points = 0
        self.step: int | None = None
        self.point = "start"
        self.point_time = clock()
        self.completed_time = self.point_time
        """Unix time of the last completed training step or validation batch, or of the start."""
        self.steps = 0
        """Training steps completed in this attempt."""
        self._depth = 0
        self._collective: tuple[str, float] | None = None  # the outermost torch.distributed call the thread is in
        self._backward_since: float | None = None  # a DDP backward (its gradient all-reduce) since the last point

    def enter_collective(self, name: str) -> None:
        """The main thread enters a blocking torch.distributed collective (nested calls count once, the outermost)."""
        now = self._clock()
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._collective = (name, now)

    def leave_collective(self) -> None:
        """The main thread returns from the collective of the matching :meth:`enter_collective`."""
        with self._lock:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                self._collective = None

    def mark_backward(self, step: int | None, *, synchronizes: bool) -> None:
        """The ``before_backward`` point; ``synchronizes``: this backward runs DDP's gradient all-reduce, so until
        the next point the rank counts as waiting in a collective."""
        self._advance("before_backward", step, completed=False, training=False)
        if synchronizes:
            with self._lock:
                self._backward_since = self.point_time

    def mark(self, point: str, step: int | None) -> None:
        """A progress point: the loop passed hook ``point`` at ``step``."""
        self._advance(point, step, completed=False, training=False)

    def complete(self, point: str, step: int | None, *, training: bool) -> None:
        """A progress point that completes a unit of work: a training step (``training``) or a validation batch."""
        self._advance(point, step, completed=True, training=training)

    def _advance(self, point: str, step: int | None, *, completed: bool, training: bool) -> None:
        now = self._clock()
        with self._lock:
            self._backward_since = None
            self.points += 1
            self.point = point
            self.step = step
            self.point_time = now
            if completed:
                self.completed_time = now
            if training:
                self.steps += 1

    def heartbeat(self, rank: int) -> Heartbeat:
        with self._lock:
            if self._collective is not None:
                collective, since = self._collective
            elif self._backward_since is not None:
                collective, since = "ddp_backward", self._backward_since
            else:
                collective, since = None, None
            return Heartbeat(
                rank=rank,
                points=self.points,
                step=self.step,
                point=self.point,
                point_time=self.point_time,
                alive_time=self._clock(),
                in_collective_since=since,
                collective=collective,
            )


class StoreLike(Protocol):
    """The subset of ``torch.distributed.Store`` the board uses."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class HeartbeatBoard:
    """Heartbeats of every rank in a store, under ``<prefix>/rank<r>``.

    Args:
        store: a ``torch.distributed.Store`` (a ``TCPStore`` client of its own, so a slow read never delays the
            training group's store traffic) or a dict-backed fake.
        prefix: keys of one run and attempt.
        world_size: number of ranks.
    """

    def __init__(self, store: StoreLike, *, prefix: str, world_size: int) -> None:
        self._store = store
        self._prefix = prefix
        self.world_size = world_size

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/rank{rank}"

    def publish(self, beat: Heartbeat) -> None:
        self._store.set(self._key(beat.rank), beat.to_json())

    def read(self) -> dict[int, Heartbeat | None]:
        """Every rank's latest heartbeat; ``None`` for a rank that never published. Never blocks on a missing key."""
        beats: dict[int, Heartbeat | None] = {}
        for rank in range(self.world_size):
            key = self._key(rank)
            try:
                beats[rank] = Heartbeat.from_json(self._store.get(key)) if self._store.check([key]) else None
            except Exception:  # noqa: BLE001 - an unreadable record counts as a silent rank
                beats[rank] = None
        return beats


def name_culprits(beats: dict[int, Heartbeat | None], *, now: float, silent_after_s: float) -> dict[str, Any]:
    """Which ranks stopped, the first one first.

    Returns ``{"ranks": [...], "first_rank": r, "silent": [...], "waiting": [...], "last_progress_time": t}``:

    - ranks that stopped publishing (``silent``, dead or frozen) if there are any, oldest last point first;
    - else, if some live ranks are not inside a collective, those of them with the fewest progress points, oldest
      last point first (ranks waiting in a collective wait for them);
    - else (every rank waits) the rank(s) with the fewest points whose collective started first.

    ``waiting`` lists the live ranks inside a collective. ``last_progress_time`` is the first culprit's last point
    (``None`` if unknown).
    """
    silent = [r for r, b in beats.items() if b is None or now - b.alive_time > silent_after_s]
    live = {r: b for r, b in beats.items() if r not in silent and b is not None}
    waiting = {r: b.in_collective_since for r, b in live.items() if b.in_collective_since is not None}
    working = {r: b for r, b in live.items() if r not in waiting}

    def last_point(rank: int) -> float:
        beat = beats[rank]
        return beat.point_time if beat is not None else float("-inf")

    if silent:
        ranks = sorted(silent, key=lambda r: (last_point(r), r))
    elif working:
        fewest = min(b.points for b in working.values())
        ranks = sorted((r for r, b in working.items() if b.points == fewest), key=lambda r: (last_point(r), r))
    elif waiting:
        # Ranks ahead wait in a later collective for those behind; among equals, the one that entered its
        # collective first waits in one the others never joined.
        fewest = min(live[r].points for r in waiting)
        behind = {r: since for r, since in waiting.items() if live[r].points == fewest}
        first = min(behind.values())
        ranks = sorted(r for r, since in behind.items() if since == first)
    else:
        ranks = []
    first = ranks[0] if ranks else None
    first_beat = beats.get(first) if first is not None else None
    return {
        "ranks": ranks,
        "first_rank": first,
        "silent": sorted(silent),
        "waiting": sorted(waiting),
        "last_progress_time": first_beat.point_time if first_beat is not None else None,
    }
