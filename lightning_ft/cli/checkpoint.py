"""``lightning-ft inspect PATH`` and ``lightning-ft export PATH OUT``: what a checkpoint holds, and one plain file of it.

Both wrap :mod:`lightning_ft.checkpoint`: :func:`~lightning_ft.checkpoint.describe` and
:func:`~lightning_ft.checkpoint.format_description` for ``inspect``, :func:`~lightning_ft.checkpoint.export_state_dict`
for ``export``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["register", "run_export", "run_inspect"]


def register(subparsers: Any) -> None:
    """Add the ``inspect`` and ``export`` subcommands to ``subparsers`` (from ``add_subparsers``)."""
    inspect = subparsers.add_parser("inspect", help="what a checkpoint holds and whether it is intact")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=run_inspect)

    export = subparsers.add_parser(
        "export", help="write one plain state dict for load_from_checkpoint or plain PyTorch"
    )
    export.add_argument("path")
    export.add_argument("out")
    export.set_defaults(func=run_export)


def run_inspect(args: argparse.Namespace) -> int:
    """Print what checkpoint ``args.path`` holds. Returns 0 if it is committed and every checksum matches, else 1."""
    from lightning_ft.checkpoint import describe, format_description

    desc = describe(args.path)
    print(json.dumps(desc, indent=2, default=str) if args.json else format_description(desc))
    return 0 if desc.get("committed") and desc.get("checksums_ok", True) else 1


def run_export(args: argparse.Namespace) -> int:
    """Write checkpoint ``args.path`` as one plain ``torch.save`` file at ``args.out``. Returns 0."""
    from lightning_ft.checkpoint import export_state_dict

    out = export_state_dict(args.path, args.out)
    print(f"wrote {out}")
    return 0
