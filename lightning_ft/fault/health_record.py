"""A node's health record: the file that keeps an evicted node out of the job until its cooldown has passed.

When a node is evicted (:func:`~lightning_ft.fault.eviction.evict_node`), one of its workers writes its
:class:`HealthRecord` beside the checkpoints, ``<dirpath>/lightning-ft/health/<node>.json`` (plain JSON, replaced
whole). A node reads its own record before it joins: the fault handler's pre-flight
(:func:`~lightning_ft.fault.eviction.refuse_if_unhealthy`) and ``lightning-ft health-gate``, which a job script runs
before every launch (:func:`check_record`).

This module imports nothing but the standard library and :mod:`lightning_ft.events`'s constants: ``health-gate`` reads
one small file, and must answer without importing torch or Lightning (seconds on a loaded node).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_ft.events import STATE_DIR

__all__ = [
    "HEALTH_SUBDIR",
    "NODE_NAME_ENV",
    "NODE_UNAVAILABLE_EXIT_CODE",
    "HealthRecord",
    "check_record",
    "health_dir",
    "node_name",
    "read_record",
    "record_path",
    "refusal_line",
    "write_record",
]

log = logging.getLogger(__name__)

NODE_UNAVAILABLE_EXIT_CODE = 69
"""``EX_UNAVAILABLE`` (sysexits.h): the exit code of a worker on an evicted node, of a worker that refuses to join,
and of ``lightning-ft health-gate`` for a node in its cooldown. Below 128, so Kubernetes' ``restartPolicy: ExitCode``
treats it as permanent (the pod is not restarted in place), and distinct from the restart code (75)."""

NODE_NAME_ENV = "LIGHTNING_FT_NODE_NAME"
"""Environment variable naming this node in health records; default: the host name. Set it where several torchrun
agents share one host (tests, a node split into several agents)."""

HEALTH_SUBDIR = Path(STATE_DIR) / "health"
"""Under the ``ModelCheckpoint`` ``dirpath``: ``<dirpath>/lightning-ft/health/<node>.json``."""


@dataclass(kw_only=True, frozen=True)
class HealthRecord:
    """What a node's health record holds (``<dirpath>/lightning-ft/health/<node>.json``, plain JSON)."""

    host: str
    """The node's name (:func:`node_name`)."""
    healthy: bool
    """False after an eviction; a node whose record says unhealthy refuses to join until ``until``."""
    source: str
    """What asked for the eviction: one of :data:`SOURCES`."""
    reason: str
    """One line: why the node was evicted."""
    time: float
    """Unix seconds at which the record was written."""
    until: float
    """Unix seconds until which the node refuses to join (``time`` plus the cooldown)."""
    ranks: tuple[int, ...] = ()
    """The global ranks the node held when it was evicted."""
    step: int | None = None
    """The global step of the eviction (its ``preempt-step=<N>`` checkpoint)."""
    run_id: str | None = None
    """The run that evicted it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the source recorded (the straggler's ratio, the failed check)."""

    def refuses(self, now: float | None = None) -> bool:
        """Whether the node must stay out at ``now`` (default: the current time)."""
        return not self.healthy and (time.time() if now is None else now) < self.until


def node_name() -> str:
    """This node's name in health records: ``LIGHTNING_FT_NODE_NAME``, else the host name."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def health_dir(dirpath: str | os.PathLike[str]) -> Path:
    """The folder of the health records of a run whose checkpoints are in ``dirpath``."""
    return Path(dirpath) / HEALTH_SUBDIR


def record_path(dirpath: str | os.PathLike[str], host: str) -> Path:
    """``<dirpath>/lightning-ft/health/<host>.json`` (characters other than ``[A-Za-z0-9._-]`` become ``_``)."""
    return health_dir(dirpath) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', host)}.json"


def write_record(dirpath: str | os.PathLike[str], record: HealthRecord) -> Path:
    """Write ``record`` atomically (a temporary file, fsync, rename, fsync of the folder); returns its path."""
    path = record_path(dirpath, record.host)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(record), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path


def read_record(dirpath: str | os.PathLike[str], host: str) -> HealthRecord | None:
    """The node's record, or ``None`` without one. A file that does not parse is reported and read as none: a
    record is only ever replaced whole, so such a file is not one of ours."""
    path = record_path(dirpath, host)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["ranks"] = tuple(raw.get("ranks", ()))
        return HealthRecord(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        log.warning("lightning-ft: ignoring unreadable health record %s (%s)", path, err)
        return None


def check_record(dirpath: str | os.PathLike[str], host: str | None = None, now: float | None = None) -> str | None:
    """The one line a node in its cooldown prints, or ``None`` when it may join. Reads one file; no collective."""
    host = host or node_name()
    record = read_record(dirpath, host)
    now = time.time() if now is None else now
    if record is None or not record.refuses(now):
        return None
    return refusal_line(record, record_path(dirpath, host), now)


def refusal_line(record: HealthRecord, path: Path, now: float) -> str:
    """``lightning-ft: node 'n' refuses to join: evicted (straggler: ...) ...; exit code 69``: one line."""
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.until))
    return (
        f"lightning-ft: node {record.host!r} refuses to join: evicted by {record.source} ({record.reason});"
        f" cooldown until {until} ({record.until - now:.0f} s left), record {path}; exit code"
        f" {NODE_UNAVAILABLE_EXIT_CODE}"
    )
