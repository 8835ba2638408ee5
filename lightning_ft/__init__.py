"""lightning-ft: make an existing PyTorch Lightning training job survive failures and show where its time goes.

Add ``strategy=ElasticFT3D(...)`` and a few callbacks to the ``Trainer`` you already have; nothing else changes.

The public names are imported on first use, so that ``import lightning_ft.strategy`` does not import the monitors
and the ``lightning-ft`` command starts without importing torch. ``import lightning_ft`` registers the strategy's names
with Lightning's ``StrategyRegistry`` (``Trainer(strategy="elastic_ft3d")``) when Lightning is imported, before or
after it (:mod:`lightning_ft.strategy.registry`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ft.strategy.registry import register_when_lightning_loads

__version__ = "0.2.0"
"""The package version; pyproject.toml reads it from here, and CHANGELOG.md's newest release heading names it."""

_EXPORTS = {
    "ElasticFT3D": "lightning_ft.strategy",
    "ElasticPolicy": "lightning_ft.elastic",
    "FaultPolicy": "lightning_ft.fault",
    "GoodputMonitor": "lightning_ft.monitors",
    "MemoryTier": "lightning_ft.checkpoint",
    "ParallelConfig": "lightning_ft.parallel",
    "Plan": "lightning_ft.parallel",
    "ReplicaGroups": "lightning_ft.replica",
    "StragglerMonitor": "lightning_ft.monitors",
    "ThermalMonitor": "lightning_ft.monitors",
    "compatible_world_sizes": "lightning_ft.elastic",
    "load_from_checkpoint": "lightning_ft.checkpoint",
    "pipeline_step": "lightning_ft.parallel",
    "plan_parallelism": "lightning_ft.parallel",
}

__all__ = [
    "ElasticFT3D",
    "ElasticPolicy",
    "FaultPolicy",
    "GoodputMonitor",
    "MemoryTier",
    "ParallelConfig",
    "Plan",
    "ReplicaGroups",
    "StragglerMonitor",
    "ThermalMonitor",
    "compatible_world_sizes",
    "load_from_checkpoint",
    "pipeline_step",
    "plan_parallelism",
]

if TYPE_CHECKING:
    from lightning_ft.checkpoint import MemoryTier, load_from_checkpoint
    from lightning_ft.elastic import ElasticPolicy, compatible_world_sizes
    from lightning_ft.fault import FaultPolicy
    from lightning_ft.monitors import GoodputMonitor, StragglerMonitor, ThermalMonitor
    from lightning_ft.parallel import ParallelConfig, Plan, pipeline_step, plan_parallelism
    from lightning_ft.replica import ReplicaGroups
    from lightning_ft.strategy import ElasticFT3D


if __name__ == "lightning_ft":  # not in lightning_ft.pytorch_lightning, built from this file
    register_when_lightning_loads()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
