"""One list of pipeline schedule names: what the runner accepts, what the planner estimates."""

from __future__ import annotations

import pytest

from lightning_ft.parallel import ClusterSpec, ModelSpec, plan_parallelism
from lightning_ft.parallel.internal import PIPELINE_SCHEDULES
from lightning_ft.parallel.pipeline import SCHEDULES as RUNNER_SCHEDULE_CLASSES
from lightning_ft.parallel.planner import SCHEDULES as PLANNED
from lightning_ft.parallel.schedules import PLANNER_SCHEDULES


def test_the_runner_has_a_schedule_class_for_every_name_and_no_other():
    assert list(RUNNER_SCHEDULE_CLASSES) == list(PIPELINE_SCHEDULES)
    assert [cls.__name__ for cls in RUNNER_SCHEDULE_CLASSES.values()] == [
        "Schedule1F1B",
        "ScheduleGPipe",
        "ScheduleInterleaved1F1B",
    ]


def test_the_planner_tries_its_schedules_by_default_and_they_are_runnable_names():
    assert PLANNED == PLANNER_SCHEDULES
    assert set(PLANNED) <= set(PIPELINE_SCHEDULES)
    plans = plan_parallelism(
        model=ModelSpec(num_layers=4, hidden_size=64, num_heads=4, vocab_size=100),
        cluster=ClusterSpec(devices_per_node=4),
        global_batch=8,
    )
    assert {plan.schedule for plan in plans if plan.config.pipeline_parallel_size > 1} == set(PLANNER_SCHEDULES)


def test_the_planner_refuses_a_schedule_it_cannot_estimate():
    with pytest.raises(ValueError, match="schedules=\\('interleaved1f1b',\\)"):
        plan_parallelism(
            model=ModelSpec(num_layers=4, hidden_size=64, num_heads=4),
            cluster=ClusterSpec(devices_per_node=4),
            global_batch=8,
            schedules=("interleaved1f1b",),
        )
