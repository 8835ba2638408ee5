"""``lightning-ft``: plan a 3D layout, inspect or export a checkpoint, summarise a run's event logs.

Each subcommand is a thin shell over a library function, so everything it prints can also be had from Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _inspect(args: argparse.Namespace) -> int:
    from lightning_ft.checkpoint.inspect import describe, format_description

    desc = describe(args.path)
    print(json.dumps(desc, indent=2, default=str) if args.json else format_description(desc))
    return 0 if desc.get("committed") and desc.get("checksums_ok", True) else 1


def _export(args: argparse.Namespace) -> int:
    from lightning_ft.checkpoint.inspect import export_state_dict

    out = export_state_dict(args.path, args.out)
    print(f"wrote {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    from lightning_ft.parallel.plan_cli import add_plan_arguments, run_plan

    parser = argparse.ArgumentParser(prog="lightning-ft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="rank 3D-parallel layouts for a model and a cluster")
    add_plan_arguments(plan)
    plan.set_defaults(func=run_plan)

    inspect = sub.add_parser("inspect", help="what a checkpoint holds and whether it is intact")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=_inspect)

    export = sub.add_parser("export", help="write one plain state dict for load_from_checkpoint or plain PyTorch")
    export.add_argument("path")
    export.add_argument("out")
    export.set_defaults(func=_export)

    report = sub.add_parser("report", help="goodput and incident summary from the event logs")
    report.add_argument("logdir", help="the trainer's default_root_dir (or its lightning_ft/events folder)")
    report.add_argument("--json", action="store_true")
    report.add_argument("--png", default=None, help="also draw a timeline (needs matplotlib)")
    report.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
