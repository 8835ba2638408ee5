"""How ``lightning-ft`` fails: one line on stderr that says what is wrong and what to do, and a documented exit code.

A subcommand raises :class:`CLIError` for anything the user can fix (a path that does not exist, a folder without
event logs, an optional dependency that is not installed, an option the library refuses);
:func:`lightning_ft.cli.main` catches it, prints ``lightning-ft <command>: error: <message>`` and returns its exit code,
so no traceback reaches the user. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

__all__ = ["EXIT_CODES_HELP", "EXIT_NO", "EXIT_OK", "EXIT_USAGE", "CLIError", "require_module", "require_path"]

EXIT_OK = 0
"""The command did what was asked, and the answer is yes."""
EXIT_NO = 1
"""The command ran and the answer is no: ``plan`` finds no layout that fits, ``inspect`` finds the checkpoint
uncommitted or a checksum wrong, ``verify`` finds a problem, ``export`` finds the checkpoint unreadable."""
EXIT_USAGE = 2
"""The command could not run as asked: a bad option, a path that does not exist, a folder without event logs, a
missing optional dependency. argparse's own usage errors use 2 too."""

EXIT_CODES_HELP = """\
exit codes:
  0  done
  1  done, and the answer is no: plan finds no layout that fits; inspect finds the checkpoint uncommitted or a
     checksum wrong; verify finds a problem; export cannot read the checkpoint
  2  could not run as asked: a bad option, a path that does not exist, no event logs under LOGDIR, or a missing
     optional dependency (one line on stderr says which, and what to do)
  69 health-gate: this node's health record keeps it out of the job (its eviction cooldown has not passed)"""
"""The exit codes as ``lightning-ft --help`` lists them."""


class CLIError(Exception):
    """A failure the user can act on, reported by :func:`lightning_ft.cli.main` as one line instead of a traceback.

    Args:
        message: what is wrong and what to do, without the ``lightning-ft <command>: error:`` prefix.
        exit_code: the process exit code, :data:`EXIT_USAGE` unless the command ran and the answer is no
            (:data:`EXIT_NO`).
    """

    def __init__(self, message: str, *, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def require_path(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if something exists there.

    Raises:
        CLIError: ``no such <what>: <path>`` (exit code 2).
    """
    path = Path(path)
    if not path.exists():
        raise CLIError(f"no such {what}: {path}")
    return path


def require_module(module: str, needed_by: str, extra: str) -> None:
    """Import ``module`` now, before the command does any work.

    Raises:
        CLIError: ``<needed_by> needs <module>: pip install 'lightning-ft[<extra>]'`` (exit code 2).
    """
    try:
        importlib.import_module(module)
    except ImportError:
        raise CLIError(f"{needed_by} needs {module}: pip install 'lightning-ft[{extra}]'") from None
