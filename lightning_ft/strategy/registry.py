"""The names under which ``ElasticFT3D`` is known to Lightning's strategy registry, registered at ``import lightning_ft``.

Lightning resolves a strategy given as a string through its ``StrategyRegistry``: ``Trainer(strategy="elastic_ft3d")``
and LightningCLI's ``--trainer.strategy=elastic_ft3d``. LightningCLI also hands ``--trainer.strategy=
lightning_ft.ElasticFT3D`` to the Trainer as a plain string (the Trainer's ``strategy`` argument accepts a string
before a ``Strategy``), and Lightning lowercases strategy strings, so the class paths are registered as names too.

``import lightning_ft`` must not import Lightning (the ``lightning-ft`` command would take seconds to start), so the
names are registered when Lightning's ``strategies`` package is imported: at once if it already is, otherwise by a
finder on ``sys.meta_path`` that runs after that package's module has executed and then removes itself. Each entry
builds the strategy through a factory that imports ``ElasticFT3D`` on first use, so registering imports nothing of
lightning-ft's strategy either. The same happens for the standalone ``pytorch_lightning`` package, whose names build
:mod:`lightning_ft.pytorch_lightning`'s ``ElasticFT3D``.

This module imports nothing but the standard library: ``lightning_ft/__init__.py`` imports it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

STRATEGY_NAMES: dict[str, dict[str, Any]] = {
    "elastic_ft3d": {},
    "elastic_ft3d_find_unused_parameters_true": {"find_unused_parameters": True},
    # What LightningCLI passes for `--trainer.strategy=lightning_ft.ElasticFT3D`, once Lightning lowercased it.
    "lightning_ft.elasticft3d": {},
    "lightning_ft.strategy.elasticft3d": {},
}
"""Registry name -> the ``ElasticFT3D`` keyword arguments it stands for (other options keep their defaults)."""

LIGHTNING_STRATEGY_PACKAGES: dict[str, str] = {
    "lightning.pytorch.strategies": "lightning_ft.strategy",
    "pytorch_lightning.strategies": "lightning_ft.pytorch_lightning.strategy",
}
"""Lightning's package that holds a ``StrategyRegistry`` -> the lightning-ft module whose ``ElasticFT3D`` it builds."""

_OURS = "_lightning_ft_strategy"  # marks a registry entry's factory as lightning-ft's


def _build(module: str, **options: Any) -> Any:
    return importlib.import_module(module).ElasticFT3D(**options)


def _factory(module: str) -> Callable[..., Any]:
    factory = functools.partial(_build, module)
    setattr(factory, _OURS, True)
    return factory


def _is_ours(entry: Any, cls: type | None) -> bool:
    if getattr(entry, _OURS, False):
        return True
    return cls is not None and getattr(entry, "__qualname__", None) == cls.__qualname__


def _register(registry: Any, strategy: Callable[..., Any], cls_name: str, cls: type | None) -> None:
    for name, options in STRATEGY_NAMES.items():
        # `registry.get` would build the strategy; the entry itself says what it builds.
        if name in registry and not _is_ours(registry[name]["strategy"], cls):
            continue  # a name another class was registered under first is left to it
        described = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "default options"
        registry.register(
            name,
            strategy,
            description=f"lightning-ft {cls_name} ({described}): fault-tolerant, elastic data x tensor x pipeline"
            " parallel training; other options through class_path and init_args",
            override=True,
            **options,
        )


def register_strategy_names(cls: type, registry: Any) -> None:
    """Register every name of :data:`STRATEGY_NAMES` for ``cls`` in Lightning's strategy ``registry``.

    Idempotent (the same class imported again replaces its entries). A name that another class was registered under
    first is left to it.
    """
    _register(registry, cls, cls.__name__, cls)


def register_lazily(registry: Any, module: str) -> None:
    """Register every name of :data:`STRATEGY_NAMES` in ``registry`` as a factory of ``module``'s ``ElasticFT3D``.

    ``module`` is imported when a name is first resolved, not now. Idempotent, like :func:`register_strategy_names`.
    """
    _register(registry, _factory(module), "ElasticFT3D", None)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for Lightning's ``strategies`` packages it hands out the spec the other finders give,
    with a loader that registers the names once the package's module has executed."""

    def __init__(self, pending: dict[str, str]) -> None:
        self._pending = pending
        self._lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with self._lock:
            module = self._pending.get(fullname)
        if module is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self, fullname, module)
        return spec

    def loaded(self, fullname: str) -> None:
        with self._lock:
            self._pending.pop(fullname, None)
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)


class _RegisteringLoader(importlib.abc.Loader):
    """The loader another finder gave, plus the registration after ``exec_module``; any other attribute is its."""

    def __init__(self, loader: Any, finder: _RegisterAfterImport, fullname: str, module: str) -> None:
        self._loader = loader
        self._finder = finder
        self._fullname = fullname
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register_lazily(module.StrategyRegistry, self._module)
        self._finder.loaded(self._fullname)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def register_when_lightning_loads() -> None:
    """Register the names with each Lightning ``StrategyRegistry``: now where its package is imported, otherwise when
    it is. Called once, by ``import lightning_ft``; imports neither Lightning nor lightning-ft's strategy."""
    pending = {}
    for package, module in LIGHTNING_STRATEGY_PACKAGES.items():
        loaded = sys.modules.get(package)
        if loaded is not None and hasattr(loaded, "StrategyRegistry"):
            register_lazily(loaded.StrategyRegistry, module)
        else:
            pending[package] = module
    if pending and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(pending))
