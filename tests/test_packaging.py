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


def test_the_version_is_written_once_and_the_changelog_and_the_installed_metadata_agree():
    import importlib.metadata
    import re

    import lightning_ft

    project = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_ft.__version__"}
    changelog = (Path(REPO_ROOT) / "CHANGELOG.md").read_text()
    newest_release = re.search(r"^## (\d+\.\d+\.\d+)\b", changelog, flags=re.M)
    assert newest_release is not None and newest_release.group(1) == lightning_ft.__version__
    # The installed metadata (a stale lightning_ft.egg-info left in a clone's root by an older build is not it).
    installed = [
        d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] == "lightning-ft"
        and Path(str(d.locate_file(""))).resolve().is_relative_to(Path(sys.prefix).resolve())
    ]
    assert installed and set(installed) == {lightning_ft.__version__}
