"""3D parallelism for ElasticFT3D: the validated configuration, the rank layout and DeviceMesh, and the planner."""

from lightning_ft.parallel.layout import MESH_DIM_NAMES, build_device_mesh
from lightning_ft.parallel.parallel_config import ClusterShape, ParallelConfig
from lightning_ft.parallel.pipeline import PipelineRunner, pipeline_step
from lightning_ft.parallel.planner import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    MemoryEstimate,
    ModelSpec,
    Plan,
    TimeEstimate,
    plan_parallelism,
)

__all__ = [
    "DEVICE_PRESETS",
    "MESH_DIM_NAMES",
    "MODEL_PRESETS",
    "ClusterShape",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "ParallelConfig",
    "PipelineRunner",
    "Plan",
    "TimeEstimate",
    "build_device_mesh",
    "pipeline_step",
    "plan_parallelism",
]
