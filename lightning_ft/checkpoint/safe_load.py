"""Loading Lightning ``.ckpt`` files and other ``torch.save`` files without unrestricted unpickling.

``torch.load(weights_only=True)`` refuses every class it does not know, and real Lightning checkpoints hold some in
``hyper_parameters``: an ``argparse.Namespace``, a ``pathlib`` path, numpy scalars and arrays, Lightning's
``AttributeDict``, the user's own enums and dataclasses. :func:`load_torch_file` allows exactly these, for the duration
of one load (torch's ``safe_globals`` context, never the process-wide list):

- a fixed list of classes whose reconstruction only builds data (see :func:`default_safe_globals`);
- enum and dataclass types named in the file whose module is **already imported**: the name is looked up in
  ``sys.modules`` and never imported, so loading a file never runs code that was not already loaded.

A file that needs anything else is refused with :class:`~lightning_ft.checkpoint.UnsafeCheckpointError`, naming the
globals that blocked it and how to allow one explicitly (``torch.serialization.safe_globals([...])`` around the call).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["default_safe_globals", "load_torch_file", "safe_globals_for"]

_BLOCKED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def _numpy_globals() -> list[Any]:
    """numpy scalars, arrays and dtypes as ``torch.save`` pickles them (numpy 1 and 2 module names)."""
    out: list[Any] = [np.ndarray, np.dtype]
    multiarray = getattr(np, "_core", None) or np.core
    for name in ("scalar", "_reconstruct"):
        fn = getattr(multiarray.multiarray, name)
        out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    for code in "?bBhHiIlLqQefdgFDGUSV":
        out.append(type(np.dtype(code)))
    return out


def default_safe_globals() -> list[Any]:
    """The classes every load allows: ``argparse.Namespace``, ``pathlib`` paths, numpy values, Lightning's
    ``AttributeDict`` (under its ``lightning`` and ``lightning_fabric``/``pytorch_lightning`` names)."""
    from lightning.fabric.utilities.data import AttributeDict

    paths = [pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    return [
        argparse.Namespace,
        *paths,
        AttributeDict,
        (AttributeDict, "lightning_fabric.utilities.data.AttributeDict"),
        (AttributeDict, "pytorch_lightning.utilities.parsing.AttributeDict"),
        *_numpy_globals(),
    ]


def _imported(name: str) -> Any:
    """The object ``module.qualname`` names if its module is already imported; never imports anything."""
    module_name, _, qualname = name.rpartition(".")
    while module_name and module_name not in sys.modules:
        module_name, _, head = module_name.rpartition(".")
        qualname = f"{head}.{qualname}"
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _data_type(name: str) -> Any:
    """The enum or dataclass type ``name`` refers to, if already imported; else ``None``."""
    obj = _imported(name)
    if isinstance(obj, type) and (issubclass(obj, enum.Enum) or dataclasses.is_dataclass(obj)):
        return (obj, name)
    return None


def safe_globals_for(path: str | os.PathLike) -> tuple[list[Any], list[str]]:
    """``(allowed, blocked)`` for the ``torch.save`` file at ``path``: the globals a load allows (the defaults plus the
    already-imported enums and dataclasses the file names) and the names still refused."""
    allowed = default_safe_globals()
    with torch.serialization.safe_globals(_new(allowed)):
        named = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    blocked = []
    for name in sorted(named):
        found = _data_type(name)
        if found is None:
            blocked.append(name)
        else:
            allowed.append(found)
    return allowed, blocked


def _new(globals_: list[Any]) -> list[Any]:
    # torch's context removes what it added on exit: leave alone what the user added process-wide already.
    present = torch.serialization.get_safe_globals()
    return [g for g in globals_ if g not in present]


@contextmanager
def _allowing(globals_: list[Any]) -> Iterator[None]:
    with torch.serialization.safe_globals(_new(globals_)):
        yield


def _refusal(path: Path, blocked: list[str], cause: str = "") -> UnsafeCheckpointError:
    names = ", ".join(blocked)
    return UnsafeCheckpointError(
        f"{path}: the file holds {names}, which lightning-ft does not load by default (it loads checkpoint files with"
        " torch.load(weights_only=True) and never unpickles arbitrary objects; argparse.Namespace, pathlib paths,"
        " numpy values, AttributeDict, and the enums and dataclasses of modules already imported are allowed). If you"
        f" trust the file, import the class and wrap the call: `with torch.serialization.safe_globals([{blocked[0]}]):"
        " trainer.fit(...)`" + (f" ({cause})" if cause else "")
    )


def load_torch_file(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` allowing what Lightning checkpoints commonly hold.

    With ``mmap=True`` tensors stay in the file until touched (cheap for reading ``global_step``).

    Raises:
        UnsafeCheckpointError: the file needs a global that is not allowed (each one is named), or is a pickle that is
            not a ``torch.save`` zip file.
        CorruptCheckpointError: a ``torch.save`` file that cannot be read (truncated, damaged).
    """
    path = Path(path)
    try:
        allowed, blocked = safe_globals_for(path)
    except ValueError as e:  # not a zip file: a legacy or foreign pickle, which weights_only loading refuses anyway
        raise UnsafeCheckpointError(
            f"{path} is not a torch.save zip file: lightning-ft loads checkpoint files only with"
            f" torch.load(weights_only=True), never through unrestricted unpickling ({e})"
        ) from e
    except Exception as e:  # noqa: BLE001 - a zip file torch's reader cannot open: damaged or truncated
        raise CorruptCheckpointError(f"{path} is not a readable torch.save file ({type(e).__name__}: {e})") from e
    if blocked:
        raise _refusal(path, blocked)
    try:
        with _allowing(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - a global pushed dynamically is only found while loading
        found = _BLOCKED_GLOBAL.search(str(e))
        if found is None:
            raise CorruptCheckpointError(f"{path} is not a readable torch.save file ({type(e).__name__}: {e})") from e
        raise _refusal(path, [found.group(1)]) from e
