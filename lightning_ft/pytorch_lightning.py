"""lightning-ft for projects that import the standalone ``pytorch_lightning`` package.

Lightning ships its trainer twice: as ``lightning.pytorch`` (in the ``lightning`` package) and as ``pytorch_lightning``
(with ``lightning_fabric``). The two are the same code under two names, and each Trainer accepts only strategies and
callbacks built on its own base classes. This module exposes every public name of :mod:`lightning_ft` built on
``pytorch_lightning``'s bases::

    import pytorch_lightning as pl
    from lightning_ft.pytorch_lightning import ElasticFT3D, GoodputMonitor, StragglerMonitor

    trainer = pl.Trainer(strategy=ElasticFT3D(), callbacks=[StragglerMonitor(), GoodputMonitor()])

There is one definition: Lightning generates ``pytorch_lightning`` from ``lightning.pytorch`` by renaming its imports,
and this module does the same to lightning-ft's own source when a module is first imported. Each module
``lightning_ft.X`` is loaded a second time as ``lightning_ft.pytorch_lightning.X`` from the same file, with the
module names of its import statements renamed (``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` ->
``lightning_fabric``, ``lightning_ft`` -> ``lightning_ft.pytorch_lightning``); nothing else in the source changes, so
the checkpoints, event logs and callback state keys of both are the same and either reads the other's.

``Trainer(strategy="elastic_ft3d")`` works with a ``pytorch_lightning.Trainer`` after ``import lightning_ft`` too.
The two sets of classes do not mix: a ``pytorch_lightning`` Trainer takes the callbacks of this module, a ``lightning``
Trainer those of :mod:`lightning_ft`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import lightning_ft

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lightning_ft import *  # noqa: F403 - the same names, built on pytorch_lightning's bases

_SOURCE_ROOT = Path(lightning_ft.__file__).parent
_PREFIX = __name__ + "."
_NOT_MIRRORED = {"pytorch_lightning", "cli"}  # this module, and the command (it imports no Lightning)

_IMPORT = re.compile(r"^(?P<head>[ \t]*(?:from|import)[ \t]+)(?P<module>[\w.]+)", re.MULTILINE)


def _renamed(module: str) -> str:
    """The module ``module`` stands for in the ``pytorch_lightning`` build (an import statement's module name)."""
    for old, new in (("lightning.pytorch", "pytorch_lightning"), ("lightning.fabric", "lightning_fabric")):
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    if (module == "lightning_ft" or module.startswith("lightning_ft.")) and not (
        module == __name__ or module.startswith(_PREFIX)
    ):
        return __name__ + module[len("lightning_ft") :]
    return module


def renamed_source(source: str) -> str:
    """``source`` with the module names of its import statements renamed for the ``pytorch_lightning`` build."""
    return _IMPORT.sub(lambda m: m.group("head") + _renamed(m.group("module")), source)


class _RenamingLoader(importlib.abc.Loader):
    """Executes one lightning-ft source file, its imports renamed, as a module of this package."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        code = compile(renamed_source(self._path.read_text()), str(self._path), "exec", dont_inherit=True)
        exec(code, module.__dict__)


class _RenamingFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_ft.pytorch_lightning.X`` at lightning-ft's own ``X`` (a module or a package)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        parts = fullname[len(_PREFIX) :].split(".")
        if parts[0] in _NOT_MIRRORED:
            return None
        base = _SOURCE_ROOT.joinpath(*parts)
        package, module = base / "__init__.py", base.with_suffix(".py")
        source = package if package.is_file() else module if module.is_file() else None
        if source is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, _RenamingLoader(source), origin=str(source), is_package=source is package
        )
        if source is package:
            spec.submodule_search_locations = [str(base)]
        spec.has_location = True
        return spec


if not any(isinstance(finder, _RenamingFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RenamingFinder())

__path__: list[str] = []  # a package: its modules are found by _RenamingFinder
__all__ = list(lightning_ft.__all__)  # the same names, built on pytorch_lightning's bases


def __getattr__(name: str) -> Any:
    module = lightning_ft._EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_renamed(module)), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(lightning_ft._EXPORTS))
