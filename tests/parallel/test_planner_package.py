"""The planner package keeps every name the single planner module had, and the parallel package its API."""

from __future__ import annotations

import lightning_ft.parallel
import lightning_ft.parallel.internal
import lightning_ft.parallel.planner as planner

PLANNER_NAMES = [
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


def test_every_public_planner_name_is_importable_from_the_package():
    assert planner.__all__ == PLANNER_NAMES
    namespace: dict[str, object] = {}
    exec(f"from lightning_ft.parallel.planner import {', '.join(PLANNER_NAMES)}", namespace)
    assert namespace["SCHEDULES"] == ("1f1b", "gpipe")
    assert namespace["GIB"] == 2**30


def _isort_key(name: str) -> tuple[int, str]:
    """Constants first, then classes, then functions, each alphabetical (ruff's RUF022 order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_package_all_lists_are_sorted_and_resolve():
    for module in (lightning_ft.parallel, planner):
        assert module.__all__ == sorted(module.__all__, key=_isort_key)
        for name in module.__all__:
            assert getattr(module, name) is not None, name
    assert {"ParallelConfig", "ClusterShape", "plan_parallelism"} <= set(lightning_ft.parallel.__all__)
    # The strategy's checks are glue, not API: its seam has them.
    assert {"PIPELINE_SCHEDULES", "check_positive_int"} <= set(lightning_ft.parallel.internal.__all__)
