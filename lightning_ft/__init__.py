"""lightning-ft: make an existing PyTorch Lightning training job survive failures and show where its time goes.

Add ``strategy=ElasticFT3D(...)`` and a few callbacks to the ``Trainer`` you already have; nothing else changes.
"""

from lightning_ft.elastic import ElasticPolicy
from lightning_ft.fault import FaultPolicy
from lightning_ft.monitors import GoodputMonitor, StragglerMonitor, ThermalMonitor
from lightning_ft.parallel import ParallelConfig, Plan, pipeline_step, plan_parallelism
from lightning_ft.strategy import ElasticFT3D

__version__ = "0.1.0"

__all__ = [
    "ElasticFT3D",
    "ElasticPolicy",
    "FaultPolicy",
    "GoodputMonitor",
    "ParallelConfig",
    "Plan",
    "StragglerMonitor",
    "ThermalMonitor",
    "pipeline_step",
    "plan_parallelism",
]
