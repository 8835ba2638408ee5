"""The ``lightning-ft`` console script as a whole: its entry point and subcommands."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import subprocess_env


def test_console_script_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ft.cli", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0
    for command in ("plan", "inspect", "export", "report"):
        assert command in proc.stdout
