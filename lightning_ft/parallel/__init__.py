"""3D parallelism for ElasticFT3D: the validated configuration, the rank layout and DeviceMesh, pipeline stages, and
the planner.

The public names are those docs/parallelism.md teaches; what the strategy, the elastic package and the CLI use
beyond them is in :mod:`lightning_ft.parallel.internal` (not API).
"""

from lightning_ft.parallel.cluster_shape import ClusterShape
from lightning_ft.parallel.layout import build_device_mesh
from lightning_ft.parallel.parallel_config import ParallelConfig
from lightning_ft.parallel.pipeline import PipelineRunner, pipeline_step
from lightning_ft.parallel.planner import DEVICE_PRESETS, MODEL_PRESETS, ClusterSpec, ModelSpec, Plan, plan_parallelism

__all__ = [
    "DEVICE_PRESETS",
    "MODEL_PRESETS",
    "ClusterShape",
    "ClusterSpec",
    "ModelSpec",
    "ParallelConfig",
    "PipelineRunner",
    "Plan",
    "build_device_mesh",
    "pipeline_step",
    "plan_parallelism",
]
