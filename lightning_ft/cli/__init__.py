"""``lightning-ft``: plan a 3D layout, inspect or export a checkpoint, summarise a run's event logs.

Each subcommand is a thin shell over a library function, so everything it prints can also be had from Python. One
module per subcommand registers its parser and runs it (:mod:`~lightning_ft.cli.plan`,
:mod:`~lightning_ft.cli.checkpoint` for ``inspect`` and ``export``, :mod:`~lightning_ft.cli.report`); each imports
the library it wraps only when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-ft`` parser with every subcommand; ``args.func(args)`` runs the chosen one."""
    from lightning_ft.cli import checkpoint, plan, report

    parser = argparse.ArgumentParser(prog="lightning-ft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan.register(sub)
    checkpoint.register(sub)
    report.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-ft`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
