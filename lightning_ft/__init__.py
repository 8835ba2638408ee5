"""lightning-ft: make an existing PyTorch Lightning training job survive failures and show where its time goes.

Add ``strategy=ElasticFT3D(...)`` and a few callbacks to the ``Trainer`` you already have; nothing else changes.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ElasticFT3D": "lightning_ft.strategy",
    "ElasticPolicy": "lightning_ft.elastic",
    "FaultPolicy": "lightning_ft.fault",
    "GoodputMonitor": "lightning_ft.monitors",
    "ParallelConfig": "lightning_ft.parallel",
    "Plan": "lightning_ft.parallel",
    "StragglerMonitor": "lightning_ft.monitors",
    "ThermalMonitor": "lightning_ft.monitors",
    "pipeline_step": "lightning_ft.parallel",
    "plan_parallelism": "lightning_ft.parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # TODO(lead): explicit imports once every package has landed
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
