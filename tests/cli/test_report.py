"""``lightning-ft report``: the options its own output names, and a start that imports neither torch nor Lightning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ft.cli import main
from tests.helpers import REPO_ROOT, subprocess_env

PREEMPTED = Path(__file__).parent.parent / "monitors" / "histories" / "preempted"
TIERS = Path(__file__).parent.parent / "monitors" / "histories" / "tiers"


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


def test_project_alone_projects_to_1k_4k_and_16k_gpus(capsys):
    assert main(["report", str(TIERS), "--project", "--json"]) == 0
    projection = json.loads(capsys.readouterr().out)["projection"]
    assert [row["gpus"] for row in projection["rows"]] == [1024, 4096, 16384]
    assert projection["mttf_points_hours"] == {"1024": 7.9, "16384": 1.8}
    assert all(row["with"] is not None for row in projection["rows"])
    assert main(["report", str(TIERS)]) == 0
    assert "goodput projection" not in capsys.readouterr().out


def test_project_takes_gpu_counts_failure_rates_and_a_durable_share(capsys):
    argv = [
        "report",
        str(TIERS),
        "--project",
        "2000",
        "--mttf-hours-at",
        "1000=10,4000=2.5",
        "--durable-fraction",
        "0.5",
    ]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    (row,) = summary["projection"]["rows"]
    # Slope -1 between the points: 5 h at 2000 GPUs.
    assert (row["gpus"], row["mttf_s"]) == (2000, pytest.approx(5 * 3600))
    assert summary["projection"]["durable_fraction"] == 0.5
    assert summary["checkpoint_intervals"]["memory"]["failure_share"] == 0.5
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MTTF 10.0h at 1000, 2.5h at 4000 GPUs (given (--mttf-hours-at))" in out
    assert "2000 GPUs (MTTF 5.0h, interpolated): without the memory tier" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--project", "1024,x"], "--project=1024,x: must be positive GPU counts separated by commas"),
        (["--project", "0"], "--project=0: must be positive GPU counts"),
        (["--project", "--mttf-hours-at", "1024"], "--mttf-hours-at=1024: must be GPUS=HOURS pairs"),
        (["--project", "--mttf-hours-at", "1024=0"], "--mttf-hours-at=1024=0: must be GPUS=HOURS pairs"),
        (["--project", "--mttf-hours-at", "1024=1,1024=2"], "each count once"),
        (["--mttf-hours-at", "1024=7.9"], "--mttf-hours-at=1024=7.9: is used only by --project; add --project"),
        (["--durable-fraction", "1.5"], "--durable-fraction=1.5: must be a share from 0 to 1"),
    ],
)
def test_bad_projection_options_are_usage_errors_before_anything_is_printed(capsys, argv, message):
    assert main(["report", str(TIERS), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


_REPORT = """
import sys

from lightning_ft.cli import main

code = main(["report", *sys.argv[1:]])
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "lightning", "pytorch_lightning"}))
sys.exit(code)
"""


def test_report_on_an_event_log_imports_neither_lightning_nor_torch():
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, str(TIERS), "--project"],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "incidents: 1 checkpoint_failed, 2 checkpoint_rejected, 1 join_refused, 1 node_evicted" in proc.stdout
    assert "16384 GPUs (MTTF 1.8h, given)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_report_and_its_png_account_for_the_steps_after_the_last_progress_line(capsys, tmp_path):
    # histories/preempted: attempt 0 trained steps 31..33 after its last progress line (step 30).
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    assert main(["report", str(PREEMPTED), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "productive 26.4s (2.4s of it estimated: 3 step(s) after its last progress line)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(PREEMPTED), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["attempts"][0]
    assert (first["estimated_steps"], first["productive_s"]) == (3, pytest.approx(26.4))
    assert not any(key.startswith("_") for key in first)  # the history's working fields stay inside


def test_an_empty_folder_says_what_keeps_the_event_log_and_when_a_plain_run_writes_it(capsys, tmp_path):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "writes it only at an incident (a crash, a hang, a preemption" in err
