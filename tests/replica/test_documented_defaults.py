"""What a SIGKILLed group costs the survivors is set by the lighthouse a user launches: the survivors' next quorum
waits for the dead group until its heartbeat times out or the join timeout ends, whichever comes first (torchft's
``quorum_compute``; tests/replica/test_replica_defaults_e2e.py measures it). So every lighthouse command the project
tells a user to run (``lightning-ft lighthouse``'s defaults, every command line in the docs and the docstrings) must
bound that wait to about a second, and ``ReplicaGroups()`` must heartbeat often enough for it. torchft's own
defaults (5 s heartbeat timeout, 60 s join timeout) cost 5 s or more."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lightning_ft.cli import build_parser
from lightning_ft.replica import ReplicaGroups
from tests.helpers import REPO_ROOT

WAIT_BOUND_S = 1.0
"""The longest the survivors' quorum may wait for a dead group (then a step, and the stall is under 1.5 s)."""
TORCHFT_DEFAULTS_MS = {"--heartbeat_timeout_ms": 5000, "--join_timeout_ms": 60000}

_SOURCES = [*sorted((Path(REPO_ROOT) / "docs").glob("*.md")), Path(REPO_ROOT) / "README.md"]
_SOURCES += sorted((Path(REPO_ROOT) / "lightning_ft").rglob("*.py")) + sorted((Path(REPO_ROOT) / "examples").rglob("*"))


def _commands(program: str) -> list[tuple[str, list[str]]]:
    """Every command line that runs ``program`` in the docs, the README, the examples and the docstrings."""
    found = []
    for path in _SOURCES:
        if not path.is_file() or path.suffix not in {".md", ".py", ".sh", ".yaml", ".yml", ""}:
            continue
        for line in path.read_text(errors="replace").splitlines():
            for match in re.finditer(rf"{re.escape(program)}((?:\s+--?[\w-]+(?:[ =][^\s`'\"|>&;)]+)?)*)", line):
                args = shlex.split(match.group(1))
                if any(a.startswith(("--min_replicas", "--min-replicas")) for a in args):  # a command, not a name
                    found.append((f"{path.relative_to(REPO_ROOT)}: {line.strip()}", args))
    return found


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def test_lightning_ft_lighthouse_defaults_bound_the_wait_for_a_dead_group():
    args = build_parser().parse_args(["lighthouse", "--min-replicas", "1"])
    assert min(args.heartbeat_timeout_s, args.join_timeout_s) <= WAIT_BOUND_S, vars(args)
    assert args.heartbeat_timeout_s <= args.join_timeout_s  # a live group late to a quorum is waited for that long


@pytest.mark.parametrize("program", ["lightning-ft lighthouse", "torchft_lighthouse"])
def test_every_documented_lighthouse_command_bounds_the_wait_for_a_dead_group(program):
    commands = _commands(program)
    assert commands  # the launch recipes name both
    for where, args in commands:
        if program == "torchft_lighthouse":
            heartbeat, join = (int(_option(args, k) or default) / 1000 for k, default in TORCHFT_DEFAULTS_MS.items())
        else:
            parsed = build_parser().parse_args(["lighthouse", "--min-replicas", "1", *_without_min(args)])
            heartbeat, join = parsed.heartbeat_timeout_s, parsed.join_timeout_s
        # The join timeout alone bounds the wait too, but the dead group then still counts as live for the heartbeat
        # timeout (the lighthouse's majority rule, every quorum in between waits for it): both short.
        assert heartbeat <= WAIT_BOUND_S, f"{where}: a dead group counts as live for {heartbeat} s"
        assert min(heartbeat, join) <= WAIT_BOUND_S, f"{where}: the survivors would wait {min(heartbeat, join)} s"


def _without_min(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--min-replicas":
            skip = True
        elif not arg.startswith("--min-replicas="):
            out.append(arg)
    return out


def test_replica_groups_heartbeat_at_least_four_times_within_the_lighthouse_s_default_heartbeat_timeout():
    lighthouse = build_parser().parse_args(["lighthouse", "--min-replicas", "1"])
    interval = ReplicaGroups(lighthouse="http://h:1", replica_id="0").resolved().heartbeat_interval.total_seconds()
    assert interval * 4 <= lighthouse.heartbeat_timeout_s  # one late heartbeat never reads as a dead group
