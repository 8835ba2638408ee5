"""``lightning-ft report LOGDIR``: goodput and incident summary of a run from its event logs.

Wraps :func:`~lightning_ft.monitors.event_log.read_events` and :mod:`lightning_ft.monitors.goodput_report`
(``summarize``, ``format_report``, and ``plot_timeline`` for ``--png``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register", "run_report"]


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    report = subparsers.add_parser("report", help="goodput and incident summary from the event logs")
    report.add_argument("logdir", help="the trainer's default_root_dir (or its lightning_ft/events folder)")
    report.add_argument("--json", action="store_true")
    report.add_argument("--png", default=None, help="also draw a timeline (needs matplotlib)")
    report.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Print the summary of the event logs under ``args.logdir``. Returns 0, or 1 if there are none."""
    from lightning_ft.monitors.event_log import read_events
    from lightning_ft.monitors.goodput_report import format_report, plot_timeline, summarize

    events = read_events(args.logdir)
    if not events:
        print(f"no lightning-ft event logs under {args.logdir}", file=sys.stderr)
        return 1
    summary = summarize(events)
    print(json.dumps(summary, indent=2, default=str) if args.json else format_report(summary))
    if args.png:
        plot_timeline(events, args.png)
        print(f"wrote {args.png}")
    return 0
