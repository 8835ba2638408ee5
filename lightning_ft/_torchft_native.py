"""torchft's native module, ``torchft._torchft`` (its lighthouse and manager servers, in Rust): loaded once, quiet
unless asked, and without torch where only the lighthouse is needed.

Two things depend on how that module is first loaded. torchft reads ``RUST_LOG`` once, then (``setup_logging`` in
its ``src/lib.rs``: INFO unless it says otherwise), and logs every quorum and vote at INFO: most of a group's
console. And importing it through the ``torchft`` package imports torch first (2 s on an idle machine, 10-30 s on a
loaded one), which ``lightning-ft lighthouse`` must not wait for: a lighthouse restarted after a failure keeps every
group waiting while it starts. So the module is loaded from its file, registered under its own name (a later
``import torchft`` uses it), with ``RUST_LOG=warn`` for the load only unless the user set ``RUST_LOG`` or
:data:`TORCHFT_LOGS_ENV`; where that fails (another layout of the package), it is imported as torchft documents it.

This module imports nothing of torch or torchft at import time. Checked against torchft 0.2.0
(``torchft/_torchft.*.so``); lightning_ft/_compat.py's docstring names it as the one place beside it that holds a
private name of another library.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["NATIVE_MODULE", "TORCHFT_LOGS_ENV", "import_torchft", "torchft_logs_wanted"]

NATIVE_MODULE = "torchft._torchft"
"""torchft's native module (torchft 0.2.0); ``torchft.coordination`` re-exports its servers and clients."""

TORCHFT_LOGS_ENV = "LIGHTNING_FT_TORCHFT_LOGS"
"""``1``: torchft's console output as torchft prints it (its Rust INFO lines, the traceback of a failed collective);
lightning_ft/replica/torchft_console.py."""


def torchft_logs_wanted() -> bool:
    """Whether the user asked for torchft's own console output (:data:`TORCHFT_LOGS_ENV`)."""
    return os.environ.get(TORCHFT_LOGS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def import_torchft() -> ModuleType:
    """torchft's native module, loaded now if it is not yet, with its Rust INFO lines off unless asked for
    (``RUST_LOG`` set by the user, or :data:`TORCHFT_LOGS_ENV`).

    Call it before anything imports torchft; a torchft imported earlier keeps the level it read then. Main thread, at
    set-up: it sets ``RUST_LOG=warn`` for the load only, then removes it again.

    Raises:
        ImportError: torchft is not installed.
    """
    loaded = sys.modules.get(NATIVE_MODULE)
    if loaded is not None:
        return loaded
    quiet = "RUST_LOG" not in os.environ and not torchft_logs_wanted()
    if quiet:
        os.environ["RUST_LOG"] = "warn"
    try:
        return _load_from_file() or importlib.import_module(NATIVE_MODULE)
    finally:
        if quiet:
            os.environ.pop("RUST_LOG", None)


def _load_from_file() -> ModuleType | None:
    package = importlib.util.find_spec("torchft")
    if package is None:
        raise ImportError("No module named 'torchft'", name="torchft")
    for location in package.submodule_search_locations or ():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(location) / f"_torchft{suffix}"
            if not path.is_file():
                continue
            spec = importlib.util.spec_from_file_location(NATIVE_MODULE, path)
            if spec is None or spec.loader is None:
                return None
            try:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except ImportError:
                return None
            sys.modules[NATIVE_MODULE] = module
            return module
    return None
