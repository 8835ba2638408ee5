"""3D parallelism for ElasticFT3D: the validated configuration, the rank layout and DeviceMesh, pipeline stages, and
the planner."""

from lightning_ft.parallel.cluster_shape import ClusterShape
from lightning_ft.parallel.layout import MESH_DIM_NAMES, build_device_mesh
from lightning_ft.parallel.parallel_config import ParallelConfig
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
from lightning_ft.parallel.schedules import PIPELINE_SCHEDULES
from lightning_ft.parallel.validation import check_positive_int

__all__ = [
    "DEVICE_PRESETS",
    "MESH_DIM_NAMES",
    "MODEL_PRESETS",
    "PIPELINE_SCHEDULES",
    "ClusterShape",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "ParallelConfig",
    "PipelineRunner",
    "Plan",
    "TimeEstimate",
    "build_device_mesh",
    "check_positive_int",
    "pipeline_step",
    "plan_parallelism",
]
