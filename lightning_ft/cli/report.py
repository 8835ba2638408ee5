"""``lightning-ft report LOGDIR``: goodput and incident summary of a run from its event logs.

Wraps :func:`~lightning_ft.events.read_events` and :mod:`lightning_ft.monitors.goodput_report`
(``summarize``, ``format_report``, and ``plot_timeline`` for ``--png``). A missing folder, a folder without event logs
``--png`` without matplotlib and a ``--mtbf-hours`` that is not a positive number are usage errors (exit code 2),
found before anything is printed. Reading the events imports neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_ft.cli.errors import EXIT_OK, CLIError, require_module, require_path

__all__ = ["register", "run_report"]


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    report = subparsers.add_parser(
        "report",
        help="goodput and incident summary from the event logs",
        epilog="exit codes: 0 printed; 2 no such folder, no event logs under it, --png without matplotlib, or a bad"
        " --mtbf-hours",
    )
    report.add_argument("logdir", help="the trainer's default_root_dir (or its lightning-ft/events folder)")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.add_argument("--png", default=None, help="also draw a timeline to this file (needs matplotlib)")
    report.add_argument(
        "--mtbf-hours",
        type=float,
        default=None,
        help="mean time between failures for the checkpoint-interval suggestion (default: the observed one, else 24)",
    )
    report.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Print the summary of the event logs under ``args.logdir``, and draw ``args.png`` if given. Returns 0.

    Raises:
        CLIError: ``args.logdir`` does not exist or holds no event logs, ``--mtbf-hours`` is not a positive number,
            or ``--png`` is given without matplotlib.
    """
    mtbf_hours = getattr(args, "mtbf_hours", None)
    if mtbf_hours is not None and not (mtbf_hours > 0 and mtbf_hours != float("inf")):
        raise CLIError(f"--mtbf-hours={mtbf_hours:g}: must be a positive, finite number of hours")
    logdir = require_path(args.logdir, "folder")
    if args.png:
        require_module("matplotlib", "--png", extra="plot")
    from lightning_ft.events import events_dir, read_events
    from lightning_ft.monitors.internal import format_report, plot_timeline, summarize

    events = read_events(logdir)
    if not events:
        # read_events takes the events folder itself as well as the root above it.
        folder = logdir if logdir.name == "events" else events_dir(logdir)
        raise CLIError(
            f"no event logs under {logdir} (expected {folder}/rank*.jsonl; pass the trainer's default_root_dir)"
        )
    summary = summarize(events, mtbf_hours=mtbf_hours)
    print(json.dumps(summary, indent=2, default=str) if args.json else format_report(summary))
    if args.png:
        plot_timeline(events, args.png)
        print(f"wrote {args.png}")
    return EXIT_OK
