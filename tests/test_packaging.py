"""Installing lightning-ft next to a user's own torch and Lightning leaves them alone."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT


def test_dependencies_are_ranges_that_leave_torch_and_lightning_to_the_user():
    deps = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.startswith("torch>") or d.startswith("torch="))
    lightning_dep = next(d for d in deps if d.startswith("lightning"))
    assert "==" not in torch_dep and ">=" in torch_dep
    assert "==" not in lightning_dep and ">=" in lightning_dep


@pytest.mark.slow
def test_pip_install_into_an_environment_with_torch_and_lightning_replaces_neither(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--no-build-isolation",
            "--report",
            str(report),
            REPO_ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    planned = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "lightning-ft" in planned
    assert not planned & {"torch", "lightning", "pytorch-lightning", "nvidia-cudnn-cu12", "triton"}, planned
