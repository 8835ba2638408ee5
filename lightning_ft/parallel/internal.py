"""The seam between the packages: what the strategy (and, where docs/architecture.md allows it, fault handling and the
CLI) use of this package beyond its public names. It is not API: users are taught the public names of
:mod:`lightning_ft.parallel` (docs/); these may change in any release. The architecture test allows this module to be
imported only by the packages that may import ``parallel`` (tests/test_architecture.py, ``ALLOWED``) and by the
tests.

The strategy checks its sizes and schedule (:func:`check_positive_int`, :data:`PIPELINE_SCHEDULES`) and maps ranks
(:func:`rank_at`); the elastic package lists divisors; the CLI's ``plan`` reads the planner's presets and constants.
"""

from lightning_ft.parallel.layout import MESH_DIM_NAMES, rank_at
from lightning_ft.parallel.planner import (
    GIB,
    OPTIMIZER_STATE_BYTES,
    RECOMPUTE,
    SCHEDULES,
    WEIGHT_BYTES,
    MemoryEstimate,
    TimeEstimate,
    activation_bytes_per_layer,
)
from lightning_ft.parallel.schedules import PIPELINE_SCHEDULES
from lightning_ft.parallel.validation import check_positive_int, divisors

__all__ = [
    "GIB",
    "MESH_DIM_NAMES",
    "MemoryEstimate",
    "OPTIMIZER_STATE_BYTES",
    "PIPELINE_SCHEDULES",
    "RECOMPUTE",
    "SCHEDULES",
    "TimeEstimate",
    "WEIGHT_BYTES",
    "activation_bytes_per_layer",
    "check_positive_int",
    "divisors",
    "rank_at",
]
