"""Every TensorBoard tag the monitors log is in docs/monitors.md, as it is logged, with the meaning of coded values.

The tags are collected from real runs of each monitor (a simulated fleet with a straggler, a fake NVML device that
throttles, a crashed and relaunched fit), so a new tag, or one renamed, fails here until the page names it.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from lightning_ft.monitors import FakeNVML, GoodputMonitor, ThermalMonitor
from lightning_ft.monitors.straggler_monitor import _PART_NAMES
from tests.helpers import REPO_ROOT
from tests.monitors.fleet import SimulatedFleet
from tests.monitors.test_goodput_monitor import fit, logged
from tests.monitors.test_replica_goodput import fit_with_replica_events, logged_rows
from tests.monitors.test_straggler_monitor import jittered
from tests.monitors.test_thermal_monitor import fake_trainer, run_windows

MONITORS_DOC = Path(REPO_ROOT) / "docs" / "monitors.md"


def _as_documented(tag: str) -> str:
    """A per-rank tag as the page writes it: ``straggler/own_ms/rank_3`` -> ``straggler/own_ms/rank_<r>``."""
    return re.sub(r"/rank_\d+$", "/rank_<r>", tag)


def _undocumented(tags: set[str]) -> list[str]:
    text = MONITORS_DOC.read_text()
    return sorted({_as_documented(t) for t in tags if f"`{_as_documented(t)}`" not in text})


def _straggler_tags(monkeypatch, tmp_path) -> set[str]:
    fleet = SimulatedFleet(monkeypatch, tmp_path, 3)
    fleet.start()
    rng = random.Random(0)
    for step in range(200):
        forward = jittered(rng, 3, 5.0)
        if step >= 117:
            forward[2] += 30.0
        fleet.step(forward=forward, data=jittered(rng, 3, 1.0))
    fleet.end()
    assert fleet.events("straggler"), "no straggler was named: the diagnosis tags were not logged"
    return {tag for _, metrics in fleet.logger.logged for tag in metrics}


def _thermal_tags(tmp_path) -> set[str]:
    nvml = FakeNVML(device_count=1)
    monitor = ThermalMonitor(interval=2, nvml=nvml)
    trainer = fake_trainer(tmp_path)
    monitor.setup(trainer, None, "fit")
    run_windows(monitor, trainer, 2)
    nvml.throttle(0, "HwSlowdown")
    run_windows(monitor, trainer, 2)
    return {tag for metrics in trainer.loggers[0].metrics for tag in metrics}


def _goodput_tags(tmp_path) -> set[str]:
    # A crash and a relaunch, so that the relaunch logs goodput/replayed_steps too.
    with pytest.raises(RuntimeError, match="injected crash"):
        fit(tmp_path, GoodputMonitor(), steps=20, crash_at=10)
    fit(tmp_path, GoodputMonitor(), steps=20, version=1)
    rows = logged(tmp_path, 0) + logged(tmp_path, 1)
    return {tag for row in rows for tag, value in row.items() if tag.startswith("goodput/") and value}


def _replica_tags(tmp_path) -> set[str]:
    # The replica mode's events (a group lost, one joined and healed): its goodput totals (the live groups are the
    # strategy's replica/live_groups, logged by no monitor).
    fit_with_replica_events(tmp_path, GoodputMonitor())
    rows = logged_rows(tmp_path)
    return {tag for row in rows for tag, value in row.items() if tag.startswith(("goodput/", "replicas/")) and value}


def test_every_tag_the_monitors_log_is_in_docs_monitors_md(monkeypatch, tmp_path):
    tags = {
        "straggler": _straggler_tags(monkeypatch, tmp_path / "straggler"),
        "thermal": _thermal_tags(tmp_path / "thermal"),
        "goodput": _goodput_tags(tmp_path / "goodput"),
    }
    for prefix, found in tags.items():
        assert found and all(t.startswith(f"{prefix}/") for t in found), (prefix, sorted(found))
    tags["replicas"] = _replica_tags(tmp_path / "replicas")
    assert {"goodput/replica_stall_s", "goodput/heal_s"} <= tags["replicas"]
    # The ones only a named straggler, a slowdown or a relaunch logs are among them.
    assert {"straggler/part", "straggler/excess_ms/compute", "straggler/suspect_rank"} <= tags["straggler"]
    assert {"thermal/slowdown/rank_0", "thermal/sm_clock_ratio/min"} <= tags["thermal"]
    assert "goodput/replayed_steps" in tags["goodput"]
    missing = _undocumented(set().union(*tags.values()))
    assert not missing, f"tags logged but not in docs/monitors.md (as `tag`): {missing}"


def test_the_values_of_straggler_part_are_in_docs_monitors_md():
    (row,) = [line for line in MONITORS_DOC.read_text().splitlines() if line.startswith("| `straggler/part`")]
    missing = [f"`{i}` {part}" for i, part in enumerate(_PART_NAMES) if f"`{i}` {part}" not in row]
    assert not missing, f"docs/monitors.md's row for straggler/part does not say what these values mean: {missing}"
