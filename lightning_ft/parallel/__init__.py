"""3D parallelism for ElasticFT3D: the validated configuration, the rank layout and DeviceMesh, and the planner."""

from lightning_ft.parallel.layout import MESH_DIM_NAMES, build_device_mesh
from lightning_ft.parallel.parallel_config import ClusterShape, ParallelConfig
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

# --- pipeline parallelism: imports from lightning_ft/parallel/pipeline*.py go here, names into __all__ below ---

__all__ = [
    "DEVICE_PRESETS",
    "MESH_DIM_NAMES",
    "MODEL_PRESETS",
    "ClusterShape",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "ParallelConfig",
    "Plan",
    "TimeEstimate",
    "build_device_mesh",
    "plan_parallelism",
]
