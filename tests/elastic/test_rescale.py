"""plan_resume and check_accumulation_scheduler: what changes when a run resumes on another data-parallel size."""

from __future__ import annotations

import math

import lightning as L
import pytest
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_ft.elastic import ElasticPolicy, compatible_world_sizes
from lightning_ft.elastic.internal import ResumeDecision, check_accumulation_scheduler, plan_resume


def plan(policy, *, saved_dp, new_dp, batch=4, new_batch=None, accumulate=1, **kwargs):
    return plan_resume(
        policy,
        saved_world_size=saved_dp,
        saved_dp_size=saved_dp,
        saved_per_device_batch=batch,
        saved_accumulate=accumulate,
        new_dp_size=new_dp,
        new_per_device_batch=batch if new_batch is None else new_batch,
        **kwargs,
    )


@pytest.mark.parametrize(("saved_dp", "new_dp", "accumulate", "expected"), [(8, 4, 1, 2), (4, 8, 2, 1), (6, 2, 3, 9)])
def test_keep_global_keeps_samples_per_step_by_changing_accumulation(saved_dp, new_dp, accumulate, expected):
    decision = plan(ElasticPolicy(), saved_dp=saved_dp, new_dp=new_dp, accumulate=accumulate)
    assert decision.accumulate_grad_batches == expected
    assert decision.global_batch_after == decision.global_batch_before == 4 * saved_dp * accumulate
    assert decision.lr_scale == 1.0


def test_keep_global_accounts_for_a_new_per_device_batch():
    decision = plan(ElasticPolicy(), saved_dp=4, new_dp=2, batch=8, new_batch=4)
    assert decision.accumulate_grad_batches == 4
    assert decision.global_batch_after == decision.global_batch_before == 32


def test_keep_global_on_an_incompatible_size_explains_the_sizes_and_the_ways_out():
    with pytest.raises(ValueError) as info:
        plan(ElasticPolicy(), saved_dp=4, new_dp=3)
    message = str(info.value)
    assert "global batch 16" in message and "data-parallel size 3" in message
    assert "batch='keep_local'" in message and "[1, 2, 4]" in message


@pytest.mark.parametrize(("lr_scaling", "expected"), [("linear", 0.5), ("sqrt", math.sqrt(0.5)), ("none", 1.0)])
def test_keep_local_changes_the_global_batch_and_scales_the_learning_rate_as_asked(lr_scaling, expected):
    decision = plan(ElasticPolicy(batch="keep_local", lr_scaling=lr_scaling), saved_dp=4, new_dp=2, accumulate=3)
    assert decision.accumulate_grad_batches == 3
    assert (decision.global_batch_before, decision.global_batch_after) == (48, 24)
    assert decision.lr_scale == pytest.approx(expected)


def test_without_a_policy_a_new_data_parallel_size_is_refused():
    with pytest.raises(ValueError, match=r"saved on 8 ranks .* on 4 ranks .* needs elastic=ElasticPolicy\(\.\.\.\)"):
        plan(None, saved_dp=8, new_dp=4, new_world_size=4)


def test_the_same_data_parallel_size_changes_nothing_even_without_a_policy():
    decision = plan(None, saved_dp=4, new_dp=4, accumulate=2)
    assert decision == ResumeDecision(
        accumulate_grad_batches=2, lr_scale=1.0, global_batch_before=32, global_batch_after=32
    )


def test_a_bad_size_is_named():
    with pytest.raises(ValueError, match=r"new_dp_size=0"):
        plan(ElasticPolicy(), saved_dp=2, new_dp=0)


def test_the_learning_rate_change_is_ramped_in_over_the_warmup_steps():
    decision = plan(ElasticPolicy(batch="keep_local", lr_warmup_steps=4), saved_dp=2, new_dp=4)
    assert decision.lr_scale == 2.0
    assert [decision.lr_scale_at(s) for s in range(6)] == [1.0, 1.25, 1.5, 1.75, 2.0, 2.0]


def test_an_accumulation_scheduler_with_keep_global_is_refused_at_setup():
    trainer = L.Trainer(callbacks=[GradientAccumulationScheduler({0: 2})], logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        check_accumulation_scheduler(trainer, ElasticPolicy())
    check_accumulation_scheduler(trainer, ElasticPolicy(batch="keep_local"))
    check_accumulation_scheduler(trainer, None)
    check_accumulation_scheduler(L.Trainer(logger=False, enable_progress_bar=False), ElasticPolicy())


def test_keep_global_with_a_new_per_device_batch_on_the_same_size_changes_accumulation():
    decision = plan(ElasticPolicy(), saved_dp=2, new_dp=2, batch=8, new_batch=4, accumulate=1)
    assert (decision.accumulate_grad_batches, decision.global_batch_after, decision.lr_scale) == (2, 16, 1.0)


def test_keep_global_keeps_an_accumulation_the_user_set_when_it_gives_the_same_global_batch():
    decision = plan(ElasticPolicy(), saved_dp=4, new_dp=2, batch=4, new_batch=4, accumulate=1, new_accumulate=2)
    assert decision.accumulate_grad_batches == 2


def test_keep_global_refuses_an_accumulation_the_user_set_that_changes_the_global_batch():
    with pytest.raises(ValueError) as info:
        plan(ElasticPolicy(), saved_dp=2, new_dp=2, batch=4, accumulate=1, new_accumulate=3)
    message = str(info.value)
    assert "Trainer(accumulate_grad_batches=3)" in message and "gives 24" in message and "global batch 8" in message
    assert "batch='keep_local'" in message


def test_keep_local_trains_with_the_users_new_accumulation_and_scales_the_learning_rate_to_it():
    decision = plan(ElasticPolicy(batch="keep_local"), saved_dp=2, new_dp=2, batch=4, accumulate=1, new_accumulate=3)
    assert (decision.accumulate_grad_batches, decision.global_batch_after, decision.lr_scale) == (3, 24, 3.0)


def test_without_a_policy_a_changed_batch_on_the_same_size_is_trained_as_configured():
    decision = plan(None, saved_dp=2, new_dp=2, batch=4, new_batch=2, accumulate=1, new_accumulate=2)
    assert (decision.accumulate_grad_batches, decision.lr_scale) == (2, 1.0)


def test_keep_global_on_an_incompatible_size_names_the_world_sizes_that_work_with_tensor_parallelism():
    with pytest.raises(ValueError) as info:
        plan(ElasticPolicy(), saved_dp=4, new_dp=3, tensor_parallel_size=2)
    message = str(info.value)
    assert "[1, 2, 4]" in message and "world sizes [2, 4, 8]" in message and "compatible_world_sizes" in message


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"global_batch": 48, "per_device_batch": 4}, [1, 2, 3, 4, 6, 12]),
        ({"global_batch": 48, "per_device_batch": 4, "tensor_parallel_size": 2}, [2, 4, 6, 8, 12, 24]),
        ({"global_batch": 48, "per_device_batch": 4, "pipeline_parallel_size": 2, "max_world_size": 8}, [2, 4, 6, 8]),
        ({"global_batch": 48, "per_device_batch": [8, 12]}, [1, 2, 3, 4, 6]),
        ({"global_batch": 10, "per_device_batch": 4}, []),
    ],
)
def test_compatible_world_sizes_lists_every_world_that_keeps_the_global_batch(kwargs, expected):
    assert compatible_world_sizes(**kwargs) == expected
    for world in expected:
        dp = world // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
        batches = kwargs["per_device_batch"]
        assert any(
            kwargs["global_batch"] % (b * dp) == 0 for b in (batches if isinstance(batches, list) else [batches])
        )


def test_compatible_world_sizes_is_public_and_refuses_bad_sizes():
    import lightning_ft

    assert lightning_ft.compatible_world_sizes is compatible_world_sizes
    with pytest.raises(ValueError, match=r"compatible_world_sizes\(per_device_batch=0\)"):
        compatible_world_sizes(global_batch=8, per_device_batch=0)
