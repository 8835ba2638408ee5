"""``lightning-ft report``: the options its own output names, and a start that imports neither torch nor Lightning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.cli import main
from tests.helpers import REPO_ROOT, subprocess_env

PREEMPTED = Path(__file__).parent.parent / "monitors" / "histories" / "preempted"


def test_the_mtbf_option_the_report_names_is_accepted(capsys):
    assert main(["report", str(PREEMPTED)]) == 0
    assert "MTBF assumed 24.0h (--mtbf-hours to change)" in capsys.readouterr().out
    assert main(["report", str(PREEMPTED), "--mtbf-hours", "12"]) == 0
    assert "MTBF 12.0h given" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_an_mtbf_that_is_not_a_positive_number_is_a_usage_error(capsys, value):
    assert main(["report", str(PREEMPTED), f"--mtbf-hours={value}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--mtbf-hours=" in captured.err and "positive" in captured.err


_REPORT = """
import sys

from lightning_ft.cli import main

code = main(["report", sys.argv[1]])
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "lightning", "pytorch_lightning"}))
sys.exit(code)
"""


def test_report_on_an_event_log_imports_neither_lightning_nor_torch():
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, str(PREEMPTED)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "incidents: 1 preempted" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"
