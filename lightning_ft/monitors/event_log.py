"""Per-rank JSON-lines event log, the record every monitor and the ``lightning-ft report`` command read.

Every rank appends one JSON object per line to ``<default_root_dir>/lightning_ft/events/rank<global_rank>.jsonl``.
Each line carries ``time``, ``run_id``, ``attempt``, ``rank``, ``event`` and ``step`` (see DESIGN.md, "Event log").
The strategy owns one :class:`EventLog` per process; callbacks reach it through :func:`get_event_log`, which also
works under strategies other than ``ElasticFT3D`` (it then opens a log of its own).

``run_id`` is stable across restarts of one run: it comes from ``LIGHTNING_FT_RUN_ID`` if set, otherwise from
``lightning_ft/run.json`` (written once, by the first attempt). ``attempt`` is counted from the run's own records
(the ``attempt_start`` lines already in the log), so a scheduler requeue that restarts torchrun still counts up.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

EVENTS_SUBDIR = Path("lightning_ft") / "events"
RUN_FILE = Path("lightning_ft") / "run.json"
_UNSET: Any = object()


def events_dir(root_dir: str | os.PathLike[str]) -> Path:
    """The folder that holds ``rank<N>.jsonl`` under a trainer's ``default_root_dir``."""
    return Path(root_dir) / EVENTS_SUBDIR


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _finite(value: Any) -> Any:
    # JSON has no NaN or infinity; a reader in another language must be able to parse every line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_events(root_or_events_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of every rank, in time order.

    Accepts a trainer's ``default_root_dir`` or the ``events`` folder itself. A torn last line (a process killed
    mid-write) is skipped.
    """
    path = Path(root_or_events_dir)
    folder = path if path.name == "events" else events_dir(path)
    events: list[dict[str, Any]] = []
    for file in sorted(folder.glob("rank*.jsonl")):
        events.extend(_iter_lines(file))
    events.sort(key=lambda e: (e.get("time", 0.0), e.get("rank", 0)))
    return events


def _iter_lines(file: Path) -> Iterator[dict[str, Any]]:
    with open(file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def resolve_run_id(root_dir: str | os.PathLike[str]) -> str:
    """The run's id: ``LIGHTNING_FT_RUN_ID``, else the one recorded in ``lightning_ft/run.json``, else a new one.

    Call on one rank (rank 0) and broadcast: the first attempt of a run writes the file.
    """
    env = os.environ.get("LIGHTNING_FT_RUN_ID")
    if env:
        return env
    run_file = Path(root_dir) / RUN_FILE
    try:
        return str(json.loads(run_file.read_text())["run_id"])
    except (OSError, ValueError, KeyError):
        pass
    run_id = uuid.uuid4().hex[:12]
    run_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = run_file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": run_id, "created": time.time()}))
    os.replace(tmp, run_file)
    return run_id


def next_attempt(root_dir: str | os.PathLike[str], run_id: str) -> int:
    """0 for the first launch of ``run_id``, else one more than the highest attempt already recorded.

    Call on one rank before any rank writes this attempt's ``attempt_start``, and broadcast the result.
    """
    highest = -1
    folder = events_dir(root_dir)
    for file in folder.glob("rank*.jsonl"):
        for event in _iter_lines(file):
            if event.get("event") == "attempt_start" and event.get("run_id") == run_id:
                highest = max(highest, int(event.get("attempt", -1)))
    return highest + 1


class EventLog:
    """Appends events of one rank to ``<root_dir>/lightning_ft/events/rank<rank>.jsonl``.

    Thread-safe: the background checkpoint writer and the training loop may both write. Each line is written with a
    single ``write`` call and flushed, so a killed process leaves at most one torn last line.

    Args:
        root_dir: the trainer's ``default_root_dir``.
        rank: the global rank of this process.
        run_id: stable across restarts of one run (see :func:`resolve_run_id`).
        attempt: 0 for the first launch, then counted up (see :func:`next_attempt`).

    Example::

        log = EventLog("runs/a", rank=0, run_id="abc", attempt=0)
        log.write("progress", step=10, productive_s=1.5, data_wait_s=0.1)
    """

    def __init__(self, root_dir: str | os.PathLike[str], *, rank: int, run_id: str, attempt: int) -> None:
        self.root_dir = Path(root_dir)
        self.rank = rank
        self.run_id = run_id
        self.attempt = attempt
        self.path = events_dir(root_dir) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._step_fn: Any = None

    def bind_step(self, step_fn: Any) -> None:
        """Use ``step_fn()`` (usually ``lambda: trainer.global_step``) for ``step`` when a write names none."""
        self._step_fn = step_fn

    def write(self, event: str, step: int | None = _UNSET, **fields: Any) -> dict[str, Any]:
        """Append one event and return it. ``step`` defaults to the bound step function, else null; pass
        ``step=None`` explicitly for an event that happens before training starts."""
        if step is _UNSET:
            step = None
            if self._step_fn is not None:
                try:
                    step = self._step_fn()
                except Exception:
                    step = None
        record: dict[str, Any] = {
            "time": time.time(),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "event": event,
            "step": step,
        }
        record.update({k: _finite(v) for k, v in fields.items()})
        line = json.dumps(record, default=_json_default, allow_nan=False) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
        return record


def get_event_log(trainer: pl.Trainer) -> EventLog:
    """The event log of this process for ``trainer``.

    Under ``ElasticFT3D`` this is the strategy's own log (one ``run_id`` and ``attempt`` for all writers). Under any
    other strategy a log is opened on first use and kept on the trainer; its ``run_id`` and ``attempt`` are resolved
    from the records on each rank independently, which is right as long as ranks start together.
    """
    strategy_log = getattr(trainer.strategy, "event_log", None)
    if isinstance(strategy_log, EventLog):
        return strategy_log
    existing = getattr(trainer, "_lightning_ft_event_log", None)
    if isinstance(existing, EventLog):
        return existing
    root = trainer.default_root_dir
    run_id = resolve_run_id(root)
    log = EventLog(root, rank=trainer.global_rank, run_id=run_id, attempt=max(next_attempt(root, run_id) - 1, 0))
    log.bind_step(lambda: trainer.global_step)
    trainer._lightning_ft_event_log = log  # type: ignore[attr-defined]
    return log
