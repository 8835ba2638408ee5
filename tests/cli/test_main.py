"""The ``lightning-ft`` console script as a whole: its entry point and subcommands."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from lightning_ft.cli import build_parser
from tests.helpers import REPO_ROOT, subprocess_env


def test_console_script_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ft.cli", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0
    for command in ("plan", "inspect", "verify", "export", "report", "health-gate", "lighthouse"):
        assert command in proc.stdout


# A command as the docs write it: `lightning-ft report`, "$ lightning-ft plan" in a shell block, and the commands
# listed after one ("`lightning-ft inspect`, `verify`, `export` and ...").
_NAMED = re.compile(r"(?:`|\$ |')lightning-ft ([a-z][\w-]*)(`(?:,? (?:and |or )?`[a-z][\w-]*`)*)?")


def _commands_named_in_docs() -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    for doc in [Path(REPO_ROOT) / "README.md", *sorted((Path(REPO_ROOT) / "docs").glob("*.md"))]:
        for match in _NAMED.finditer(doc.read_text()):
            commands = [match.group(1), *re.findall(r"`([a-z][\w-]*)`", match.group(2) or "")]
            for command in commands:
                named.setdefault(command, []).append(doc.name)
    return named


def _subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_every_command_the_docs_name_exists_and_every_command_is_in_the_docs():
    named = _commands_named_in_docs()
    missing = {command: docs for command, docs in named.items() if command not in _subcommands()}
    assert not missing, f"the docs name lightning-ft commands that do not exist: {missing}"
    undocumented = sorted(_subcommands() - set(named))
    assert not undocumented, f"lightning-ft commands no doc names: {undocumented}"
