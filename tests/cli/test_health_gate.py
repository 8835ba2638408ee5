"""``lightning-ft health-gate`` runs before every launch: it reads one JSON file and must answer without importing
torch or Lightning (20-27 s on a loaded node when it did). The decisions themselves are tests/fault/test_eviction.py's."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from lightning_ft.fault.internal import NODE_UNAVAILABLE_EXIT_CODE, HealthRecord, write_record
from tests.helpers import REPO_ROOT, subprocess_env

# The console script as installed: pyproject's [project.scripts] entry, imported and called as pip's wrapper does.
_ENTRY = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]["scripts"]["lightning-ft"]
_GATE = """
import importlib
import sys

module, _, function = sys.argv[1].partition(":")
code = getattr(importlib.import_module(module), function)(["health-gate", *sys.argv[2:]])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "lightning", "pytorch_lightning", "numpy"})
print(heavy)
sys.exit(code)
"""


def _gate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _GATE, _ENTRY, *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", ["refused", "healthy", "first launch"])
def test_health_gate_answers_without_importing_torch_or_lightning(tmp_path, case):
    now = time.time()
    if case != "first launch":
        refused = case == "refused"
        record = HealthRecord(
            host="node-a", healthy=not refused, source="straggler", reason="rank 3 at 2.5x", time=now, until=now + 600
        )
        write_record(tmp_path, record)
    proc = _gate("--dirpath", str(tmp_path / ("never-written" if case == "first launch" else "")), "--node", "node-a")
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr[-3000:]
    if case == "refused":
        assert proc.returncode == NODE_UNAVAILABLE_EXIT_CODE, proc.stderr
        assert proc.stderr.count("\n") == 1 and "node 'node-a' refuses to join: evicted by straggler" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr


_DASH_M = """
import runpy
import sys

sys.argv = ["lightning-ft", "health-gate", "--dirpath", sys.argv[1]]
try:
    runpy.run_module("lightning_ft.cli", run_name="__main__")
except SystemExit as exit:
    print(exit.code)
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "lightning", "pytorch_lightning"}))
"""


def test_python_dash_m_health_gate_imports_neither_torch_nor_lightning(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _DASH_M, str(tmp_path)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.split() == ["0", "[]"], proc.stdout + proc.stderr[-3000:]
