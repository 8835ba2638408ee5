"""A planner that ranks 3D-parallel layouts of a GPT-style model on a cluster by estimated step time.

:func:`plan_parallelism` tries every factorisation of the world size into data x tensor x pipeline, every micro-batch
size and pipeline schedule, and estimates for each the memory per device and the step time. The package has three
parts: what is planned for (:mod:`~lightning_ft.parallel.planner.specs`: :class:`ModelSpec`, :class:`ClusterSpec` and
their presets), the cost model (:mod:`~lightning_ft.parallel.planner.cost_model`: memory and time of one layout), and
the search (:mod:`~lightning_ft.parallel.planner.search`: :func:`plan_parallelism` and its :class:`Plan`).
"""

from lightning_ft.parallel.planner.cost_model import (
    OPTIMIZER_STATE_BYTES,
    RECOMPUTE,
    WEIGHT_BYTES,
    MemoryEstimate,
    TimeEstimate,
    activation_bytes_per_layer,
)
from lightning_ft.parallel.planner.search import SCHEDULES, Plan, plan_parallelism
from lightning_ft.parallel.planner.specs import DEVICE_PRESETS, GIB, MODEL_PRESETS, ClusterSpec, ModelSpec

__all__ = [
    "DEVICE_PRESETS",
    "GIB",
    "MODEL_PRESETS",
    "OPTIMIZER_STATE_BYTES",
    "RECOMPUTE",
    "SCHEDULES",
    "WEIGHT_BYTES",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "TimeEstimate",
    "activation_bytes_per_layer",
    "plan_parallelism",
]
