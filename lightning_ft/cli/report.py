"""``lightning-ft report LOGDIR``: goodput and incident summary of a run from its event logs.

Wraps :func:`~lightning_ft.events.read_events`, :mod:`lightning_ft.monitors.goodput_report` (``summarize``, and
``plot_timeline`` for ``--png``) and :mod:`lightning_ft.monitors.goodput_text` (``format_report``). A missing folder,
a folder without event logs, ``--png`` without matplotlib, a ``--mtbf-hours`` that is not a positive number, a ``--project`` that is not a list
of positive GPU counts, a ``--mttf-hours-at`` that is not ``GPUS=HOURS,...`` (or is given without ``--project``)
and a ``--durable-fraction`` outside [0, 1] are usage errors (exit code 2), found before anything is printed.
Reading the events imports neither torch nor Lightning.

Replica groups (docs/replica-groups.md): each group is its own run with its own event log. On a folder that holds no
run of its own but replica groups' runs below it (each group's ``default_root_dir`` inside it), or with ``--job``
(groups sharing one ``default_root_dir`` are its runs), the report is the whole job's, one per lighthouse
(:mod:`lightning_ft.monitors.replica_job`); ``--png`` and the projection options are for one run and are usage errors
there. A folder with a run of its own is reported as before: ``--job`` is the one way to ask for the job there, so
that the single-run report of a group's folder stays what it was.

``--project`` takes an optional value (``--project`` alone projects to 1024, 4096 and 16384 GPUs, ``--project
2048,8192`` to those): the common question is "what would this run give at the usual scales", so the flag alone
answers it, and the comma list keeps one flag for one question instead of repeating it per scale.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_ft.cli.errors import EXIT_OK, CLIError, require_module, require_path

__all__ = ["register", "run_report"]


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    report = subparsers.add_parser(
        "report",
        help="goodput and incident summary from the event logs",
        epilog="exit codes: 0 printed; 2 no such folder, no event logs under it, --png without matplotlib, or a bad"
        " --mtbf-hours, --project, --mttf-hours-at or --durable-fraction",
    )
    report.add_argument("logdir", help="the trainer's default_root_dir (or its lightning-ft/events folder)")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.add_argument(
        "--job",
        action="store_true",
        help="replica groups: one report of the whole job from every group's run under LOGDIR (the default when"
        " LOGDIR holds no run of its own but groups' runs below it)",
    )
    report.add_argument("--png", default=None, help="also draw a timeline to this file (needs matplotlib)")
    report.add_argument(
        "--mtbf-hours",
        type=float,
        default=None,
        help="mean time between failures for the checkpoint-interval suggestion (default: the observed one, else 24)",
    )
    from lightning_ft.monitors.internal import DEFAULT_MTTF_HOURS_AT, DEFAULT_PROJECT_GPUS

    default_gpus = ",".join(map(str, DEFAULT_PROJECT_GPUS))
    default_mttf = ",".join(f"{n}={h:g}" for n, h in DEFAULT_MTTF_HOURS_AT.items())
    report.add_argument(
        "--project",
        nargs="?",
        const=default_gpus,
        default=None,
        metavar="GPUS",
        help=f"project the effective training time ratio to these GPU counts, comma-separated (alone: {default_gpus}),"
        " with and without the memory tier, from this run's own save, load and restart costs",
    )
    report.add_argument(
        "--mttf-hours-at",
        default=None,
        metavar="GPUS=HOURS,...",
        help=f"mean time to failure by job size for --project (default {default_mttf}: Meta's research clusters,"
        " Kokolis et al. 2024); read off on log-log axes between and beyond the points",
    )
    report.add_argument(
        "--durable-fraction",
        type=float,
        default=None,
        metavar="F",
        help="share of failures, 0 to 1, that need the durable tier when a memory tier is in use (default 0.126, from"
        " Llama 3's interruptions that lost a host's memory); sets each tier's interval and --project's 'with' column",
    )
    report.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Print the summary of the event logs under ``args.logdir``, and draw ``args.png`` if given. Returns 0.

    Raises:
        CLIError: ``args.logdir`` does not exist or holds no event logs, ``--mtbf-hours`` is not a positive number,
            ``--project``, ``--mttf-hours-at`` or ``--durable-fraction`` breaks its rule (see the module docstring),
            or ``--png`` is given without matplotlib.
    """
    mtbf_hours = getattr(args, "mtbf_hours", None)
    if mtbf_hours is not None and not (mtbf_hours > 0 and mtbf_hours != float("inf")):
        raise CLIError(f"--mtbf-hours={mtbf_hours:g}: must be a positive, finite number of hours")
    project_gpus = _project_gpus(getattr(args, "project", None))
    mttf_hours_at = _mttf_hours_at(getattr(args, "mttf_hours_at", None))
    if mttf_hours_at is not None and project_gpus is None:
        raise CLIError(f"--mttf-hours-at={args.mttf_hours_at}: is used only by --project; add --project")
    durable_fraction = getattr(args, "durable_fraction", None)
    if durable_fraction is not None and not 0 <= durable_fraction <= 1:
        raise CLIError(f"--durable-fraction={durable_fraction:g}: must be a share from 0 to 1")
    logdir = require_path(args.logdir, "folder")
    if args.png:
        require_module("matplotlib", "--png", extra="plot")
    from lightning_ft.events import concurrent_runs, events_dir, read_events
    from lightning_ft.monitors.internal import format_report, plot_timeline, summarize

    events = read_events(logdir)
    if getattr(args, "job", False) or (not events and not concurrent_runs(logdir)):
        runs = _job_runs(logdir, forced=getattr(args, "job", False))
        if runs:
            return _print_job(runs, args)
    # The other runs of this folder (other experiments started from it, runs started while another was live) keep
    # their logs apart: named, reported on their own.
    others = concurrent_runs(logdir)
    listed = "; ".join(f"lightning-ft report {p}" for p in others)
    if not events and others:
        raise CLIError(f"no event logs of the run that owns {logdir}; the other runs of this folder: {listed}")
    if not events:
        # read_events takes the events folder itself as well as the root above it.
        folder = logdir if logdir.name == "events" else events_dir(logdir)
        raise CLIError(
            f"no event logs under {logdir} (expected {folder}/rank*.jsonl; pass the trainer's default_root_dir). A"
            " one-process run started without torchrun or SLURM and without a lightning-ft monitor keeps its event"
            " log in memory and writes it only at an incident (a crash, a hang, a preemption, a rejected checkpoint):"
            " add GoodputMonitor() or set LIGHTNING_FT_EVENT_LOG=always to keep it from the start"
        )
    summary = summarize(
        events,
        mtbf_hours=mtbf_hours,
        durable_fraction=durable_fraction,
        project_gpus=project_gpus,
        mttf_hours_at=mttf_hours_at,
    )
    print(json.dumps(summary, indent=2, default=str) if args.json else format_report(summary))
    if others:
        print(
            f"note: {len(others)} other run(s) of {logdir} (other checkpoint folders, or started while another run"
            f" was live) keep their own event logs: {listed}",
            file=sys.stderr if args.json else sys.stdout,
        )
    if args.png:
        plot_timeline(events, args.png)
        print(f"wrote {args.png}")
    return EXIT_OK


def _job_runs(logdir: Any, *, forced: bool) -> list[dict[str, Any]]:
    """The replica groups' runs under ``logdir``; with ``--job`` none is a usage error."""
    from lightning_ft.monitors.internal import find_group_runs

    runs = find_group_runs(logdir)
    if forced and not runs:
        raise CLIError(
            f"--job: no replica group's event log under {logdir} (a group's log holds replica_group or replica events;"
            " pass the folder that holds the groups' default_root_dir)"
        )
    return runs


def _print_job(runs: list[dict[str, Any]], args: argparse.Namespace) -> int:
    """Print the job report of each job (lighthouse) among ``runs``. Returns 0."""
    from lightning_ft.monitors.internal import format_job_report, summarize_job

    one_run = [
        flag
        for flag, value in (
            ("--png", args.png),
            ("--project", getattr(args, "project", None)),
            ("--mttf-hours-at", getattr(args, "mttf_hours_at", None)),
            ("--mtbf-hours", getattr(args, "mtbf_hours", None)),
            ("--durable-fraction", getattr(args, "durable_fraction", None)),
        )
        if value is not None
    ]
    if one_run:
        folders = sorted({r["folder"] for r in runs})
        raise CLIError(
            f"{', '.join(one_run)}: for one run, not a job of replica groups; pass one group's folder instead (one of"
            f" {', '.join(folders)})"
        )
    jobs: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        jobs.setdefault(run["job"], []).append(run)
    summaries = [summarize_job(group_runs) for group_runs in jobs.values()]
    if args.json:
        print(json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2, default=str))
    else:
        print("\n\n".join(format_job_report(s) for s in summaries))
    return EXIT_OK


def _positive_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _project_gpus(value: str | None) -> list[int] | None:
    """``--project``'s value as GPU counts."""
    if value is None:
        return None
    gpus = [_positive_int(part) for part in value.split(",")]
    if not gpus or any(n is None for n in gpus):
        raise CLIError(f"--project={value}: must be positive GPU counts separated by commas, e.g. 1024,4096,16384")
    return [n for n in gpus if n is not None]


def _mttf_hours_at(value: str | None) -> dict[int, float] | None:
    """``--mttf-hours-at``'s value as GPU count -> hours."""
    if value is None:
        return None
    rule = "must be GPUS=HOURS pairs separated by commas, positive counts and hours, each count once"
    points: dict[int, float] = {}
    for part in value.split(","):
        gpus, sep, hours = part.partition("=")
        n = _positive_int(gpus)
        try:
            h = float(hours)
        except ValueError:
            h = float("nan")
        if not sep or n is None or n in points or not (0 < h < float("inf")):
            raise CLIError(f"--mttf-hours-at={value}: {rule} (e.g. 1024=7.9,16384=1.8)")
        points[n] = h
    return points
