"""Recorded per-step timings of real runs on a busy 2-core host, for the detector's and the monitor's replays.

Two formats: ``data/*.json`` (0.2.0: each rank's own time per step, ``own_ms``) and ``histories/busy_host/*.json.gz``
(recorded by ``benchmarks/straggler_detection.py --record`` with CPU burners loading the host: each part of each
step in hundredths of a millisecond, ``data_ms``, ``compute_ms``, ``backward_ms``, and the load average measured while
it ran). Every trace is a healthy run: no rank was slowed down on purpose.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
BUSY_HOST = HERE / "histories" / "busy_host"


@dataclass(frozen=True)
class Trace:
    name: str
    own_ms: np.ndarray
    """Steps x ranks: data wait plus compute, as StragglerMonitor's own time (NaN where unknown)."""
    parts_ms: dict[str, np.ndarray]
    """``data``, ``compute``, ``backward``, each steps x ranks (empty for the 0.2.0 traces)."""
    load_average: float
    """Median 1-minute load average while it ran (NaN where not recorded)."""
    note: str


def load_trace(path: Path | str) -> Trace:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        raw = json.load(f)

    def matrix(rows: list, scale: float = 1.0) -> np.ndarray:
        return np.array([[np.nan if v is None else v * scale for v in r] for r in rows], dtype=float).T

    if "own_ms" in raw:
        own, parts = matrix(raw["own_ms"]), {}
    else:
        unit = raw["unit_ms"]
        parts = {name: matrix(raw[f"{name}_ms"], unit) for name in ("data", "compute", "backward")}
        own = parts["data"] + parts["compute"]
    load = raw.get("load_average", {}).get("median", float("nan"))
    return Trace(path.name, own, parts, float(load), raw.get("note", ""))


def busy_host_traces() -> list[Path]:
    return sorted(BUSY_HOST.glob("*.json.gz"))
