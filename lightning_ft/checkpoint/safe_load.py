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

A user's own ``CheckpointIO`` plugin reads checkpoint files instead where the Trainer has one
(:mod:`~lightning_ft.checkpoint.file_reader`).
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import enum
import importlib
import io
import os
import pathlib
import pickle
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_ft.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from lightning_ft.checkpoint.file_checks import damaged_records

__all__ = [
    "allow_code",
    "default_safe_globals",
    "globals_to_allow",
    "load_pickled",
    "load_torch_file",
    "pickled_bytes",
    "resolve_weights_only",
    "safe_globals_for",
    "safe_globals_option",
    "say_unrestricted",
    "unrestricted",
    "unrestricted_load",
    "weights_only_scope",
]

# What torch's restricted unpickler says when it meets a global it does not allow: a GLOBAL opcode, or a class it was
# asked to build (numpy's dtype classes, for one) that only shows while loading. Only its "allowlisted via
# `add_safe_globals`" messages name a class that allowing would let through: "Can only SETITEM for dict, ... but got
# <class 'collections.defaultdict'>" (an OmegaConf config composed by Hydra holds one) is refused whatever is allowed.
_BLOCKED_GLOBAL = re.compile(
    r"GLOBAL (\S+) was not an allowed global|allowlisted via `add_safe_globals`,? but got <class '([^']+)'>"
)


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


def globals_to_allow(source: str | os.PathLike | io.BytesIO | bytes, blocked: list[str]) -> list[str]:
    """The one list of globals every message names for a ``torch.save`` file or payload whose load is ``blocked``
    (the save-time warning, the refusal at load, ``lightning-ft export``): every global the pickle names beyond
    torch's and lightning-ft's defaults, the already-imported dataclasses and enums included (allowed here
    automatically, but not in a process that has not imported their module), plus ``blocked`` (a class met only while
    loading). ``[]`` when nothing is blocked."""
    if not blocked:
        return []
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    if isinstance(source, io.BytesIO):
        source.seek(0)
    try:
        with torch.serialization.safe_globals(_new(default_safe_globals())):
            named = torch.serialization.get_unsafe_globals_in_checkpoint(
                source if isinstance(source, io.BytesIO) else str(source)
            )
    except Exception:  # noqa: BLE001 - what blocks the load is named all the same
        named = []
    return sorted(set(named) | {b for b in blocked if "." in b and " " not in b}) or list(blocked)


def _new(globals_: list[Any]) -> list[Any]:
    # torch's context removes what it added on exit: leave alone what the user added process-wide already.
    present = torch.serialization.get_safe_globals()
    return [g for g in globals_ if g not in present]


@contextmanager
def _allowing(globals_: list[Any]) -> Iterator[None]:
    with torch.serialization.safe_globals(_new(globals_)):
        yield


def _module_and_name(name: str) -> tuple[str, str]:
    """``(module, qualname)`` of the dotted global ``name``: the longest prefix that is an imported module (never
    imports), else the part before the last dot."""
    module_name, _, qualname = name.rpartition(".")
    probe, rest = module_name, qualname
    while probe and probe not in sys.modules:
        probe, _, head = probe.rpartition(".")
        rest = f"{head}.{rest}"
    return (probe, rest) if probe else (module_name, qualname)


def _needs_pair(name: str) -> bool:
    """Whether ``add_safe_globals`` needs ``(obj, name)`` for the global ``name``: an object without its own module
    and qualified name (``Ellipsis``), which torch cannot name by itself."""
    obj = _imported(name)
    if obj is None:
        return False
    return not (hasattr(obj, "__module__") and hasattr(obj, "__qualname__"))


def allow_code(names: list[str] | tuple[str, ...]) -> str:
    """The Python that allows the globals ``names`` (dotted, as torch names them), as printed in every warning and
    refusal: the imports, then one ``torch.serialization.add_safe_globals([...])`` with the pair form
    ``(obj, "module.Name")`` where torch needs it (``builtins.Ellipsis``). Paste it before ``fit`` in every process."""
    modules = sorted({_module_and_name(n)[0] for n in names} | {"torch"})
    items = []
    for name in names:
        module, qualname = _module_and_name(name)
        ref = f"{module}.{qualname}"
        items.append(f"({ref}, {name!r})" if _needs_pair(name) else ref)
    return f"import {', '.join(modules)}; torch.serialization.add_safe_globals([{', '.join(items)}])"


def safe_globals_option(names: list[str] | tuple[str, ...]) -> str:
    """The ``lightning-ft export --safe-globals`` value that allows the globals ``names`` (``module:Name,...``),
    which :func:`~lightning_ft.cli.checkpoint.parse_safe_globals` reads back."""
    return ",".join(":".join(_module_and_name(name)) for name in names)


def invalid_safe_globals() -> list[Any]:
    """Entries of torch's process-wide allowed globals that torch cannot name (``add_safe_globals([Ellipsis])``):
    with one of them every ``weights_only`` load fails inside torch with an ``AttributeError``."""
    bad = []
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            continue
        if not (hasattr(entry, "__module__") and hasattr(entry, "__qualname__")):
            bad.append(entry)
    return bad


_SINGLETON_NAMES = {id(Ellipsis): "builtins.Ellipsis", id(NotImplemented): "builtins.NotImplemented"}


def _check_safe_globals(where: str) -> None:
    """Refuse, with the code that works, a process-wide allowed global torch cannot name."""
    bad = invalid_safe_globals()
    if not bad:
        return
    pairs = ", ".join(f"({b!r}, {_SINGLETON_NAMES.get(id(b), 'module.Name')!r})" for b in bad)
    raise UnsafeCheckpointError(
        f"{where}: torch.serialization.add_safe_globals was given {', '.join(map(repr, bad))}, which has no"
        " __module__/__qualname__, so torch cannot name it and refuses every restricted load (the checkpoint itself"
        f" is intact). Allow it as a pair instead: `torch.serialization.add_safe_globals([{pairs}])`"
    )


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``weights_only`` as ``torch.load`` resolves it (and so Lightning's ``fit/validate/test/predict(...,
    weights_only=...)``, which hands it to ``torch.load``): ``None`` is ``True`` (torch >= 2.6) unless
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes it ``True`` always."""
    true_values = ("1", "y", "yes", "true")
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in true_values:
        return True
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in true_values
    return bool(weights_only)


_unrestricted: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_ft_unrestricted", default=False)


@contextmanager
def weights_only_scope(weights_only: bool | None) -> Iterator[None]:
    """Within it, objects stored pickled in a lightning-ft checkpoint (:func:`load_pickled`) load as
    ``torch.load(weights_only=False)`` would load them when ``weights_only`` resolves to ``False``
    (:func:`resolve_weights_only`); the caller says it (:func:`say_unrestricted`)."""
    token = _unrestricted.set(not resolve_weights_only(weights_only))
    try:
        yield
    finally:
        _unrestricted.reset(token)


def unrestricted() -> bool:
    """Whether a :func:`weights_only_scope` with ``weights_only=False`` is in force."""
    return _unrestricted.get()


_said_unrestricted: set[str] = set()


def say_unrestricted(what: str) -> None:
    """Say, once per ``what`` (a load of one checkpoint) in this process, that it is loaded with
    ``weights_only=False``."""
    if what not in _said_unrestricted:
        _said_unrestricted.add(what)
        warnings.warn(
            f"lightning-ft: {what} with weights_only=False, as Lightning does when asked to: objects stored in the"
            " checkpoint are unpickled without restriction (this runs code the file names; only for checkpoints you"
            " trust)",
            stacklevel=4,
        )


def _unreadable(path: Path, e: BaseException) -> CheckpointError:
    """The error for a ``torch.save`` file whose load failed otherwise than on a global: corrupt only where its bytes
    fail the zip's CRC32; an intact file that cannot be deserialized is named as such."""
    damaged = damaged_records(path)
    if damaged:
        return CorruptCheckpointError(
            f"{path} is not a readable torch.save file: {', '.join(damaged)} fail(s) the zip's CRC32"
            f" ({type(e).__name__}: {e})"
        )
    return CheckpointError(
        f"{path}: the file is intact (every record matches its zip CRC32) but cannot be deserialized in this process"
        f" ({type(e).__name__}: {e})"
    )


def unrestricted_load(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=False)``: what Lightning does with ``weights_only=False``;
    said once per process.

    Raises:
        CorruptCheckpointError: the file's bytes fail the zip's CRC32 (truncated, damaged).
        CheckpointError: an intact file that cannot be deserialized (a class missing in this process, say).
    """
    path = Path(path)
    say_unrestricted(f"loading {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - whatever the file's objects raise while they are built
        raise _unreadable(path, e) from e


def _refusal(path: Path, blocked: list[str], cause: str = "") -> UnsafeCheckpointError:
    names = ", ".join(blocked)
    return _naming(
        blocked,
        UnsafeCheckpointError(
            f"{path}: the file holds {names}, which lightning-ft does not load by default (it loads checkpoint files with"
            " torch.load(weights_only=True), as Lightning does by default on torch >= 2.6; argparse.Namespace, pathlib"
            " paths, numpy values, AttributeDict, and the enums and dataclasses of modules already imported are allowed)."
            f" If you trust the file, allow them before fit in every process: `{allow_code(blocked)}`, or pass"
            " weights_only=False to fit/validate/test/predict as with Lightning" + (f" ({cause})" if cause else "")
        ),
    )


def _naming(names: list[str], error: UnsafeCheckpointError) -> UnsafeCheckpointError:
    error.globals_to_allow = list(names)  # type: ignore[attr-defined] - read by lightning-ft export's refusal
    return error


def load_torch_file(path: str | os.PathLike, *, mmap: bool = False, weights_only: bool | None = True) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` allowing what Lightning checkpoints commonly hold;
    with ``weights_only`` resolving to ``False`` (:func:`resolve_weights_only`: Lightning's ``weights_only=False``),
    :func:`unrestricted_load`, as Lightning loads it.

    With ``mmap=True`` tensors stay in the file until touched (cheap for reading ``global_step``).

    Raises:
        UnsafeCheckpointError: the file needs a global that is not allowed (each one is named), or is a pickle that is
            not a ``torch.save`` zip file.
        CorruptCheckpointError: a ``torch.save`` file that cannot be read (truncated, damaged).
    """
    path = Path(path)
    if not resolve_weights_only(weights_only):
        return unrestricted_load(path, mmap=mmap)
    _check_safe_globals(str(path))
    try:
        allowed, blocked = safe_globals_for(path)
    except ValueError as e:  # not a zip file: a legacy or foreign pickle, which weights_only loading refuses anyway
        raise UnsafeCheckpointError(
            f"{path} is not a torch.save zip file: a plain pickle, which torch.load(weights_only=True) does not read"
            f" (Lightning's default, and lightning-ft's); pass weights_only=False only if you trust the file ({e})"
        ) from e
    except Exception as e:  # noqa: BLE001 - a zip file torch's reader cannot open: damaged or truncated
        raise _unreadable(path, e) from e
    if blocked:
        # Whether allowing them would be enough is not tried here: that load would run the file's code with globals
        # the user has not allowed. Once they are, a refusal of another kind says weights_only=False (below).
        raise _refusal(path, globals_to_allow(path, blocked))
    try:
        with _allowing(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - a global pushed dynamically is only found while loading
        found = _blocked_in(e)
        if found is None:
            if isinstance(e, pickle.UnpicklingError) and not damaged_records(path):
                raise _refusal_whatever_is_allowed(path, str(e)) from e
            raise _unreadable(path, e) from e
        raise _refusal(path, globals_to_allow(path, [found])) from e


def _stored_refusal_whatever_is_allowed(where: str, reason: str) -> UnsafeCheckpointError:
    reason = _reason(reason)
    return _naming(
        [],
        UnsafeCheckpointError(
            f"{where}: the checkpoint stores an object that torch.load(weights_only=True) (Lightning's default on"
            f" torch >= 2.6, and lightning-ft's) cannot read whatever globals are allowed ({reason}). If you trust the"
            " checkpoint, pass weights_only=False to fit/validate/test/predict, as Lightning needs it for this object"
            " too"
        ),
    )


def _refusal_whatever_is_allowed(path: Path, reason: str) -> UnsafeCheckpointError:
    reason = _reason(reason)
    return _naming(
        [],
        UnsafeCheckpointError(
            f"{path}: torch.load(weights_only=True) (Lightning's default on torch >= 2.6, and lightning-ft's) cannot"
            f" read this file whatever globals are allowed ({reason}). If you trust the file, pass weights_only=False"
            " to fit/validate/test/predict, as Lightning needs it for this file too"
        ),
    )


def _allow_hint(blocked: list[str]) -> str:
    return (
        "If you trust these classes, allow them in every process that saves or loads, before fit:"
        f" `{allow_code(blocked)}` (docs/checkpointing.md#your-own-classes-in-a-checkpoint), or pass"
        " weights_only=False to fit/validate/test/predict as with Lightning"
    )


_warned: set[tuple[str, tuple[str, ...]]] = set()
_checked: set[tuple[str, str, frozenset[str]]] = set()


_UNREADABLE = "a pickle torch's restricted unpickler cannot read whatever is allowed"
"""How :func:`_load_blockers` begins the entry it returns for a pickle that no allowed global lets through."""


def _as_allowed(names: list[str]) -> list[Any] | None:
    """``names`` as ``add_safe_globals`` takes them (the pair form where torch needs it), or ``None`` if one of them
    is not imported in this process (it is never imported here)."""
    out: list[Any] = []
    for name in names:
        obj = _imported(name)
        if obj is None:
            return None
        out.append((obj, name) if _needs_pair(name) else obj)
    return out


def _reason(error: BaseException | str) -> str:
    """The first line of what torch's restricted unpickler says after ``WeightsUnpickler error:``."""
    text = str(error).split("WeightsUnpickler error:", 1)[-1].strip()
    return text.splitlines()[0] if text else "refused"


def _refused_whatever_is_allowed(source: io.BytesIO, allowed: list[Any], names: list[str]) -> str | None:
    """Why torch's restricted unpickler refuses ``source`` with ``allowed`` and the globals ``names`` allowed too, where
    no allowed global would let it through (torch's message); ``None`` when it loads then, or when that cannot be
    told in this process (a global in ``names`` whose module is not imported, a class met only while loading).

    For the save call only, on the bytes of the user's own objects pickled a moment ago: never on a file being loaded,
    whose code that load would run with globals the user has not allowed."""
    extra = _as_allowed(names)
    if extra is None:
        return None
    source.seek(0)
    try:
        with _allowing([*allowed, *extra]):
            torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _blocked_in(e) is None:
            return _reason(e)
    except Exception:  # noqa: BLE001 - anything else is not the restricted unpickler's refusal
        return None
    return None


def _load_blockers(data: bytes) -> list[str]:
    """What stops :func:`load_pickled` from reading ``data`` in this process: the globals torch's scanner finds, and
    failing those, a class the restricted unpickler meets only while it loads (``[]``: it loads). One entry that
    begins with :data:`_UNREADABLE` when allowing the globals would not let it load either."""
    try:
        allowed, blocked = safe_globals_for(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - torch's scanner reads only the opcodes its restricted unpickler knows
        return [f"a pickle torch's restricted unpickler cannot read ({type(e).__name__}: {e})"]
    if blocked:
        names = globals_to_allow(data, blocked)
        reason = _refused_whatever_is_allowed(io.BytesIO(data), allowed, names)
        return [f"{_UNREADABLE} ({reason})"] if reason else names
    try:
        with _allowing(allowed):
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever stops the load is what the warning must name
        found = _blocked_in(e)
        if found is None:
            return [f"a pickle torch's restricted unpickler cannot read ({type(e).__name__}: {e})"]
        return globals_to_allow(data, [found])
    return []


def _stage_loads_unrestricted() -> bool:
    """Whether the running ``fit``/``validate``/``test``/``predict`` was given a ``weights_only`` that resolves to
    ``False`` (its loads, and the auto-resume of the same script after a crash, unpickle without restriction)."""
    from lightning_ft import _compat

    given = _compat.stage_weights_only()
    return given is not None and not resolve_weights_only(given)


def pickled_bytes(obj: Any, where: str) -> bytes:
    """``torch.save(obj)`` as bytes; called at the save call.

    The save never fails for a class that is not allowed (a save that ``DDPStrategy`` makes must not fail under
    ``ElasticFT3D``): the object is stored, and a warning, once per key, names ``where`` (the key in the checkpoint), the
    globals a load will need and how to allow them, so that the resume after a crash is not the first to learn it.
    Loading it stays refused until they are allowed (:func:`load_pickled`). No warning in a stage run with
    ``weights_only=False`` (``fit(..., weights_only=False)``, as plain Lightning needs it for such objects): its resume,
    explicit or automatic, loads them as Lightning does, and ``DDPStrategy`` says nothing either.

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
    if _stage_loads_unrestricted():
        return buffer.getvalue()
    # Once per key, class and set of allowed globals in this process: the check loads the object back.
    checked = (where, name, frozenset(map(str, torch.serialization.get_safe_globals())))
    if checked in _checked:
        return buffer.getvalue()
    _checked.add(checked)
    blocked = _load_blockers(buffer.getvalue())
    if blocked and blocked[0].startswith(_UNREADABLE) and (where, tuple(blocked)) not in _warned:
        _warned.add((where, tuple(blocked)))
        warnings.warn(
            f"lightning-ft checkpoint: {where} is a {name}, which has no plain encoding: it is stored pickled, and"
            f" torch.load(weights_only=True) (Lightning's default on torch >= 2.6, and lightning-ft's) cannot read it"
            f" back whatever globals are allowed{blocked[0][len(_UNREADABLE) :]}, so a resume from this checkpoint is"
            " refused unless fit/validate/test/predict are given weights_only=False, as Lightning needs it for this"
            " object too (only for checkpoints you trust); or keep it out of the checkpoint (for hyperparameters:"
            " save_hyperparameters(ignore=[...]))",
            stacklevel=3,
        )
    elif blocked and (where, tuple(blocked)) not in _warned:
        _warned.add((where, tuple(blocked)))
        warnings.warn(
            f"lightning-ft checkpoint: {where} is a {name}, which has no plain encoding: it is stored pickled, and"
            f" loading it back needs {', '.join(blocked)}, which lightning-ft does not unpickle unless allowed, so a"
            " resume from this checkpoint is refused until then. "
            + _allow_hint(blocked)
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
    if _unrestricted.get():  # said by the load of the checkpoint (weights_only_scope's caller)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - whatever the object raises while it is built
            raise CheckpointError(f"{where}: the stored object cannot be built ({type(e).__name__}: {e})") from e
    _check_safe_globals(where)
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
                if isinstance(e, pickle.UnpicklingError):
                    raise _stored_refusal_whatever_is_allowed(where, str(e)) from e
                # Its bytes were checked (the document's crc32): intact, but not buildable here.
                raise CheckpointError(f"{where}: the stored object cannot be built ({type(e).__name__}: {e})") from e
            blocked = [found]
    names = globals_to_allow(data, blocked)  # not tried with them allowed: that would run the stored object's code
    raise _naming(
        names,
        UnsafeCheckpointError(
            f"{where}: the checkpoint stores an object that needs {', '.join(names)}, which are not all allowed"
            " globals in this process, so lightning-ft does not unpickle it. " + _allow_hint(names)
        ),
    )
