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

The same rule loads the objects that a lightning-ft checkpoint stores pickled (:func:`pickled_bytes`,
:func:`load_pickled`): an object of a class the user allowed through torch's own list
(``torch.serialization.add_safe_globals``), which the JSON codec cannot store as plain data. They are written with
``torch.save`` and read back with ``torch.load(weights_only=True)``, torch's restricted unpickler, which admits only
the allowed globals; a payload that needs any other global (a tampered one calling ``os.system``, say) is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["default_safe_globals", "load_pickled", "load_torch_file", "pickled_bytes", "safe_globals_for"]

# What torch's restricted unpickler says when it meets a global it does not allow: a GLOBAL opcode, or a class it was
# asked to build (numpy's dtype classes, for one) that only shows while loading.
_BLOCKED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global|but got <class '([^']+)'>")


def _blocked_in(error: BaseException) -> str | None:
    found = _BLOCKED_GLOBAL.search(str(error))
    return (found.group(1) or found.group(2)) if found is not None else None


def _numpy_globals() -> list[Any]:
    """numpy scalars, arrays and dtypes as ``torch.save`` pickles them (numpy 1 and 2 module names)."""
    out: list[Any] = [np.ndarray, np.dtype]
    # By the version, not by which attribute exists: numpy 1.26 has a ``numpy._core`` stub (for reading numpy 2
    # pickles) without ``multiarray`` once something imported it.
    numpy_2 = int(np.__version__.split(".")[0]) >= 2
    multiarray = importlib.import_module("numpy._core.multiarray" if numpy_2 else "numpy.core.multiarray")
    for name in ("scalar", "_reconstruct"):
        fn = getattr(multiarray, name)
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


def safe_globals_for(path: str | os.PathLike | io.BytesIO) -> tuple[list[Any], list[str]]:
    """``(allowed, blocked)`` for the ``torch.save`` file at ``path`` (or in a buffer): the globals a load allows (the
    defaults, torch's list, plus the already-imported enums and dataclasses the file names) and the names still
    refused."""
    allowed = default_safe_globals()
    source = path if isinstance(path, io.BytesIO) else str(path)
    with torch.serialization.safe_globals(_new(allowed)):
        named = torch.serialization.get_unsafe_globals_in_checkpoint(source)
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
        found = _blocked_in(e)
        if found is None:
            raise CorruptCheckpointError(f"{path} is not a readable torch.save file ({type(e).__name__}: {e})") from e
        raise _refusal(path, [found]) from e


_ALLOW_HINT = (
    "If you trust the class, allow it in every process that saves or loads, before fit:"
    " `torch.serialization.add_safe_globals([{name}])` (docs/checkpointing.md#your-own-classes-in-a-checkpoint)"
)


_warned: set[tuple[str, tuple[str, ...]]] = set()
_checked: set[tuple[str, str, frozenset[str]]] = set()


def _load_blockers(data: bytes) -> list[str]:
    """What stops :func:`load_pickled` from reading ``data`` in this process: the globals torch's scanner finds, and
    failing those, a class the restricted unpickler meets only while it loads (``[]``: it loads)."""
    try:
        allowed, blocked = safe_globals_for(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - torch's scanner reads only the opcodes its restricted unpickler knows
        return [f"a pickle torch's restricted unpickler cannot read ({type(e).__name__}: {e})"]
    if blocked:
        return blocked
    try:
        with _allowing(allowed):
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever stops the load is what the warning must name
        return [_blocked_in(e) or f"a pickle torch's restricted unpickler cannot read ({type(e).__name__}: {e})"]
    return []


def pickled_bytes(obj: Any, where: str) -> bytes:
    """``torch.save(obj)`` as bytes; called at the save call.

    The save never fails for a class that is not allowed (a save that ``DDPStrategy`` makes must not fail under
    ``ElasticFT3D``): the object is stored, and a warning, once per key, names ``where`` (the key in the checkpoint), the
    globals a load will need and how to allow them, so that the resume after a crash is not the first to learn it.
    Loading it stays refused until they are allowed (:func:`load_pickled`).

    Raises:
        TypeError: ``obj`` cannot be pickled at all (``torch.save``, and so ``DDPStrategy``, fails on it too); the
            message names ``where`` and what to do.
    """
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except Exception as e:  # noqa: BLE001 - pickling runs the object's own __reduce__
        raise TypeError(
            f"{where}: a {name} cannot be stored in a lightning-ft checkpoint: it has no plain encoding and cannot be"
            f" pickled ({type(e).__name__}: {e}). Keep it out of the checkpoint (for hyperparameters:"
            " save_hyperparameters(ignore=[...]))"
        ) from e
    # Once per key, class and set of allowed globals in this process: the check loads the object back.
    checked = (where, name, frozenset(map(str, torch.serialization.get_safe_globals())))
    if checked in _checked:
        return buffer.getvalue()
    _checked.add(checked)
    blocked = _load_blockers(buffer.getvalue())
    if blocked and (where, tuple(blocked)) not in _warned:
        _warned.add((where, tuple(blocked)))
        warnings.warn(
            f"lightning-ft checkpoint: {where} is a {name}, which has no plain encoding: it is stored pickled, and"
            f" loading it back needs {', '.join(blocked)}, which lightning-ft does not unpickle unless allowed, so a"
            " resume from this checkpoint is refused until then. "
            + _ALLOW_HINT.format(name=", ".join(blocked))
            + "; or keep it out of the checkpoint (for hyperparameters: save_hyperparameters(ignore=[...]))",
            stacklevel=3,
        )
    return buffer.getvalue()


def load_pickled(data: bytes, where: str) -> Any:
    """The object :func:`pickled_bytes` stored, through torch's restricted unpickler (``weights_only=True``) with the
    allowed globals only; tensors come back on the CPU.

    Raises:
        UnsafeCheckpointError: the payload needs a global that is not allowed (in this process), naming ``where``.
        CorruptCheckpointError: the payload is not a readable ``torch.save`` buffer.
    """
    try:
        allowed, blocked = safe_globals_for(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - not a torch.save buffer at all
        raise CorruptCheckpointError(f"{where}: the stored object is not a readable torch.save payload ({e})") from e
    if not blocked:
        try:
            with _allowing(allowed):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a global pushed dynamically is only found while loading
            found = _blocked_in(e)
            if found is None:
                raise CorruptCheckpointError(
                    f"{where}: the stored object cannot be read ({type(e).__name__}: {e})"
                ) from e
            blocked = [found]
    raise UnsafeCheckpointError(
        f"{where}: the checkpoint stores an object that needs {', '.join(blocked)}, which is not an allowed global in"
        " this process, so lightning-ft does not unpickle it. " + _ALLOW_HINT.format(name=", ".join(blocked))
    )
