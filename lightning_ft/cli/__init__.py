"""``lightning-ft``: plan a 3D layout, inspect, verify or export a checkpoint, report on a run, gate a node, lighthouse.

Each subcommand is a thin shell over a library function, so everything it prints can also be had from Python. One
module per subcommand registers its parser and runs it (:mod:`~lightning_ft.cli.plan`,
:mod:`~lightning_ft.cli.checkpoint` for ``inspect``, ``verify`` and ``export``, :mod:`~lightning_ft.cli.report`,
:mod:`~lightning_ft.cli.health_gate`, :mod:`~lightning_ft.cli.lighthouse`); each imports
the library it wraps only when it runs. :func:`main` registers in full only the subcommand it runs (``plan``'s
options need the planner, which imports torch), so ``lightning-ft report`` imports neither torch nor Lightning.

A failure the user can act on is printed as one line on stderr, ``lightning-ft <command>: error: <what to do>``, and
the process exits with a documented code (:mod:`~lightning_ft.cli.errors`): 0 done, 1 done and the answer is no,
2 could not run as asked.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_ft.cli.errors import EXIT_CODES_HELP, CLIError

__all__ = ["build_parser", "main"]


_MODULES = {
    "plan": "plan",
    "inspect": "checkpoint",
    "verify": "checkpoint",
    "export": "checkpoint",
    "report": "report",
    "health-gate": "health_gate",
    "lighthouse": "lighthouse",
}
"""Subcommand -> the module of :mod:`lightning_ft.cli` that registers and runs it."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lightning-ft`` parser; ``args.func(args)`` runs the chosen subcommand.

    ``command``: the one subcommand to register in full (the others get an empty parser, so the name is still
    accepted); ``None`` or an unknown name registers every one in full (for ``--help`` and usage errors).
    """
    full = set(_MODULES.values()) if command not in _MODULES else {_MODULES[command]}
    parser = argparse.ArgumentParser(
        prog="lightning-ft",
        description=__doc__.splitlines()[0],
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _MODULES.items():
        if module not in full:
            sub.add_parser(name)
        elif name == next(n for n, m in _MODULES.items() if m == module):  # one register() per module
            importlib.import_module(f"lightning_ft.cli.{module}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-ft`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    A :class:`~lightning_ft.cli.errors.CLIError` from the subcommand is printed as one line on stderr and its exit
    code returned; argparse's own usage errors exit with 2 (``SystemExit``), as argparse does.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as error:
        print(f"lightning-ft {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
