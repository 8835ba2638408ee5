"""``lightning-ft health-gate --dirpath DIR``: may this node join the job? For a job script, before torchrun starts.

Wraps :func:`~lightning_ft.fault.health_record.check_record`: it reads this node's health record
(``<DIR>/lightning-ft/health/<node>.json``, written when the node was evicted) and exits with 0 when the node may
join (no folder or record yet, a healthy record, a passed cooldown), or prints one line and exits with 69 (``EX_UNAVAILABLE``) while the record's cooldown lasts. Run before torchrun,
the refusal costs the other nodes nothing; a worker that refuses after the rendezvous makes every node start a new
round (docs/fault-tolerance.md, "Health records and the cooldown"). It imports neither torch nor Lightning (only
:mod:`~lightning_ft.fault.health_record`, through the lazy seam), so it answers in a fraction of a second before
every launch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_ft.cli.errors import EXIT_OK

__all__ = ["register", "run_health_gate"]


def register(subparsers: Any) -> None:
    """Add the ``health-gate`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    gate = subparsers.add_parser(
        "health-gate",
        help="exit 69 with one line if this node's health record keeps it out of the job (run before torchrun)",
        epilog="exit codes: 0 the node may join (no record yet, a healthy one or a passed cooldown); 69 the node is in"
        " its eviction cooldown",
    )
    gate.add_argument("--dirpath", required=True, help="the ModelCheckpoint dirpath of the run (shared by all nodes)")
    gate.add_argument(
        "--node", default=None, help="the node's name (default: LIGHTNING_FT_NODE_NAME, else the host name)"
    )
    gate.set_defaults(func=run_health_gate)


def run_health_gate(args: argparse.Namespace) -> int:
    """Print the refusal line and return 69, or return 0."""
    from lightning_ft.fault.internal import NODE_UNAVAILABLE_EXIT_CODE, check_record

    # A folder that does not exist yet (the first launch) holds no record: the node may join.
    line = check_record(args.dirpath, args.node)
    if line is None:
        return EXIT_OK
    print(line, file=sys.stderr)
    return NODE_UNAVAILABLE_EXIT_CODE
