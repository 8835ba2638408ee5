"""``lightning-ft inspect PATH``, ``verify PATH`` and ``export PATH OUT``: what a checkpoint holds, whether it is sound,
and one plain file of it.

Each wraps :mod:`lightning_ft.checkpoint`: :func:`~lightning_ft.checkpoint.describe` and
:func:`~lightning_ft.checkpoint.format_description` for ``inspect``, :func:`~lightning_ft.checkpoint.verify` for
``verify``, :func:`~lightning_ft.checkpoint.export_checkpoint` for ``export``. A path that does not exist is a usage
error (exit code 2), checked before anything is read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning_ft.cli.errors import EXIT_NO, EXIT_OK, CLIError, require_path

__all__ = ["parse_safe_globals", "register", "run_export", "run_inspect", "run_verify"]


def register(subparsers: Any) -> None:
    """Add the ``inspect``, ``verify`` and ``export`` subcommands to ``subparsers`` (from ``add_subparsers``)."""
    inspect = subparsers.add_parser(
        "inspect",
        help="what a checkpoint holds and whether it is intact",
        epilog="exit codes: 0 committed and every checksum matches; 1 not committed or a checksum wrong; "
        "2 no such checkpoint",
    )
    inspect.add_argument("path", help="a checkpoint directory, e.g. checkpoints/epoch=0-step=100.ckpt")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(func=run_inspect)

    verify = subparsers.add_parser(
        "verify",
        help="read every shard of a checkpoint and check it: commit marker, metadata, checksums, coverage of every"
        " tensor",
        epilog="exit codes: 0 sound; 1 a problem found (each printed on its own line); 2 no such checkpoint",
    )
    verify.add_argument("path", help="a checkpoint directory or file, e.g. checkpoints/epoch=0-step=100.ckpt")
    verify.add_argument("--json", action="store_true", help='print {"path": ..., "problems": [...]} as JSON')
    verify.set_defaults(func=run_verify)

    export = subparsers.add_parser(
        "export",
        help="write one plain Lightning .ckpt file (full tensors) for load_from_checkpoint, plain PyTorch or another"
        " strategy",
        epilog="exit codes: 0 written; 1 the checkpoint cannot be read (not committed, corrupt); "
        "2 no such checkpoint, or OUT's folder does not exist",
    )
    export.add_argument("path", help="a committed checkpoint directory")
    export.add_argument("out", help="the file to write (its folder must exist)")
    export.add_argument(
        "--full",
        action="store_true",
        help="also write optimizer, LR scheduler, loop and callback state, so that Trainer.fit(ckpt_path=OUT) resumes"
        " under another strategy (DDPStrategy)",
    )
    export.add_argument(
        "--safe-globals",
        default="",
        metavar="MODULE:NAME,...",
        help="classes the checkpoint stores objects of (as torch.serialization.add_safe_globals allows them for a"
        " training script), e.g. pytorch_forecasting.metrics:QuantileLoss; each module is imported. Security: reading"
        " the checkpoint may then create objects of these classes from the file's data (their __setstate__ runs):"
        " name only classes you trust, for a checkpoint from storage you trust",
    )
    export.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    export.set_defaults(func=run_export)


def run_inspect(args: argparse.Namespace) -> int:
    """Print what checkpoint ``args.path`` holds. Returns 0 if it is committed and every checksum matches, else 1.

    Raises:
        CLIError: nothing exists at ``args.path``.
    """
    require_path(args.path, "checkpoint")
    from lightning_ft.checkpoint.internal import describe, format_description

    desc = describe(args.path)
    print(json.dumps(desc, indent=2, default=str) if args.json else format_description(desc))
    return EXIT_OK if desc.get("committed") and desc.get("checksums_ok", True) else EXIT_NO


def run_verify(args: argparse.Namespace) -> int:
    """Read every shard of checkpoint ``args.path`` and print what is wrong with it, one problem a line (or that it is
    sound). Returns 0 when it is sound, else 1.

    Raises:
        CLIError: nothing exists at ``args.path``.
    """
    require_path(args.path, "checkpoint")
    from lightning_ft.checkpoint import verify

    problems = verify(args.path)
    if args.json:
        print(json.dumps({"path": str(args.path), "problems": problems}, indent=2))
    elif problems:
        print(f"{args.path}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
    else:
        print(
            f"{args.path}: sound (committed, metadata intact, every shard read and its checksum matches, every tensor"
            " covered)"
        )
    return EXIT_NO if problems else EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    """Write checkpoint ``args.path`` as one plain Lightning ``.ckpt`` file at ``args.out`` (with ``--full``: the whole
    training state), one tensor at a time with a progress bar on stderr. Returns 0.

    ``args.safe_globals`` (``--safe-globals``) names the classes allowed for this read only (torch's
    ``safe_globals`` context, not the process-wide list).

    Raises:
        CLIError: nothing exists at ``args.path`` or ``args.out``'s folder does not exist, or ``--safe-globals`` names
            something that cannot be imported (exit code 2), or the checkpoint cannot be read (exit code 1).
    """
    require_path(args.path, "checkpoint")
    require_path(Path(args.out).absolute().parent, "folder for OUT")
    import torch

    from lightning_ft.checkpoint import CheckpointError
    from lightning_ft.checkpoint.internal import export_checkpoint

    allowed = parse_safe_globals(args.safe_globals)
    try:
        with torch.serialization.safe_globals(allowed):
            out = export_checkpoint(args.path, args.out, full=args.full, progress=not args.no_progress)
    except CheckpointError as error:
        # The library's message names the checkpoint and what is wrong with it; no traceback adds to that.
        raise CLIError(f"cannot export: {error}", exit_code=EXIT_NO) from None
    print(f"wrote {out}")
    return EXIT_OK


def parse_safe_globals(value: str) -> list[Any]:
    """The classes (or functions) ``--safe-globals`` names: comma-separated ``module:qualified.Name``, each module
    imported, as ``torch.serialization.safe_globals`` takes them (``(obj, "module.Name")`` for an object torch cannot
    name by itself, such as ``builtins:Ellipsis``). An empty value names none; the value an export refusal prints is
    read back as printed.

    Raises:
        CLIError: an entry is not ``MODULE:NAME``, its module cannot be imported or has no such name (exit code 2).
    """
    import importlib

    found: list[Any] = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        module_name, sep, name = entry.partition(":")
        if not sep or not module_name or not name:
            raise CLIError(f"--safe-globals={value}: {entry!r} is not MODULE:NAME (e.g. torch.nn:ModuleList)")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in name.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as error:
            raise CLIError(f"--safe-globals={value}: cannot find {entry!r} ({error})") from None
        # torch names a global by its object's own module and name (an alias such as torch.nn:Linear is the class);
        # one without them (builtins:Ellipsis) is allowed under the name given, as the pair torch accepts.
        named = hasattr(obj, "__module__") and hasattr(obj, "__qualname__")
        found.append(obj if named else (obj, f"{module_name}.{name}"))
    return found
