"""The ElasticPolicy at a change of the live replica groups: the arithmetic, the set-up check, the learning-rate factor
composed with an elastic resume's, and the bitwise hand-over of the rates to a healed group."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ft import ElasticPolicy
from lightning_ft.elastic.internal import (
    LRScale,
    ResumeDecision,
    ScaledLearningRates,
    check_replica_policy,
    plan_replica_batch,
    replica_policy_message,
)

SIZES = {"num_groups": 3, "group_size": 1, "device_batch": 4, "accumulate": 2}


def test_keep_global_keeps_the_global_batch_of_the_full_membership_by_changing_accumulation():
    full = plan_replica_batch(ElasticPolicy(), live_groups=3, **SIZES)
    two = plan_replica_batch(ElasticPolicy(), live_groups=2, **SIZES)
    one = plan_replica_batch(ElasticPolicy(), live_groups=1, **SIZES)
    assert [p.accumulate_grad_batches for p in (full, two, one)] == [2, 3, 6]
    assert {p.global_batch for p in (full, two, one)} == {24} and full.reference_global_batch == 24
    assert {p.lr_scale for p in (full, two, one)} == {1.0}  # keep_global leaves the learning rate
    # Ranks per group count: two groups of 2 ranks at batch 3, accumulation 1: 12 samples, 2 per micro-batch row.
    two_ranks = plan_replica_batch(
        ElasticPolicy(), live_groups=1, num_groups=2, group_size=2, device_batch=3, accumulate=1
    )
    assert (two_ranks.accumulate_grad_batches, two_ranks.global_batch) == (2, 12)


@pytest.mark.parametrize(("rule", "expected"), [("linear", 2 / 3), ("sqrt", math.sqrt(2 / 3)), ("none", 1.0)])
def test_keep_local_keeps_the_per_group_batch_and_scales_the_learning_rate_by_the_rule(rule, expected):
    plan = plan_replica_batch(ElasticPolicy(batch="keep_local", lr_scaling=rule), live_groups=2, **SIZES)
    assert (plan.accumulate_grad_batches, plan.global_batch, plan.lr_scale) == (2, 16, expected)
    assert plan_replica_batch(ElasticPolicy(batch="keep_local"), live_groups=3, **SIZES).lr_scale == 1.0


def test_no_policy_changes_nothing():
    plan = plan_replica_batch(None, live_groups=1, **SIZES)
    assert (plan.accumulate_grad_batches, plan.global_batch, plan.lr_scale) == (2, 8, 1.0)


def test_keep_global_that_cannot_divide_at_some_membership_is_refused_at_set_up_naming_the_rule_and_the_ways_out():
    with pytest.raises(ValueError) as error:
        check_replica_policy(
            ElasticPolicy(),
            num_groups=3,
            num_groups_known=True,
            min_replicas=1,
            group_size=1,
            device_batch=8,
            accumulate=1,
        )
    message = str(error.value)
    for part in (
        "ElasticPolicy(batch='keep_global')",
        "24 samples (num_groups 3 x ranks per group 1 x per-device batch 8 x accumulate_grad_batches 1)",
        "from min_replicas=1 to num_groups=3",
        "at 2 live groups the accumulation would be 24 / (per-device batch 8 x ranks per group 1 x 2 groups) = 1.5",
        "accumulate_grad_batches = global batch / (per-device batch x ranks per group x live groups)",
        "Trainer(accumulate_grad_batches=2)",  # lcm(2/gcd(2,3), 1) = 2 serves 1, 2 and 3 live groups
        "ReplicaGroups(min_replicas=3)",
        "ElasticPolicy(batch='keep_local')",
    ):
        assert part in message, (part, message)
    # Each way out is indeed accepted.
    ok = {"num_groups": 3, "num_groups_known": True, "group_size": 1, "device_batch": 8}
    check_replica_policy(ElasticPolicy(), min_replicas=1, accumulate=2, **ok)
    check_replica_policy(ElasticPolicy(), min_replicas=3, accumulate=1, **ok)
    check_replica_policy(ElasticPolicy(batch="keep_local"), min_replicas=1, accumulate=1, **ok)
    # 4 groups, accumulation 2: 3 live does not divide 8; the smallest accumulation for 1..4 is lcm(1, 1, 3, 1) x 1 = 3.
    with pytest.raises(ValueError, match=r"at 3 live groups .* Trainer\(accumulate_grad_batches=3\)"):
        check_replica_policy(ElasticPolicy(), min_replicas=1, accumulate=2, **{**ok, "num_groups": 4})


def test_a_policy_that_scales_needs_the_full_membership_and_says_how_to_give_it():
    unknown = {"num_groups": 1, "num_groups_known": False, "min_replicas": 1, "group_size": 1, "device_batch": 8}
    for policy in (ElasticPolicy(), ElasticPolicy(batch="keep_local", lr_scaling="sqrt")):
        with pytest.raises(ValueError, match=r"ReplicaGroups\(num_groups=\.\.\.\) or the environment variable"):
            check_replica_policy(policy, accumulate=1, **unknown)
    check_replica_policy(ElasticPolicy(batch="keep_local", lr_scaling="none"), accumulate=1, **unknown)
    check_replica_policy(None, accumulate=1, **unknown)


def test_more_groups_than_num_groups_under_keep_global_fail_with_the_rule_when_they_cannot_divide():
    assert plan_replica_batch(ElasticPolicy(), live_groups=6, **SIZES).accumulate_grad_batches == 1
    with pytest.raises(ValueError, match="at 4 live groups"):
        plan_replica_batch(ElasticPolicy(), live_groups=4, **SIZES)


def test_the_console_line_says_each_change():
    before = plan_replica_batch(ElasticPolicy(), live_groups=3, **SIZES)
    after = plan_replica_batch(ElasticPolicy(), live_groups=2, **SIZES)
    assert replica_policy_message(before, after, first=False, warmup_steps=0) == (
        "lightning-ft: replica groups 3 -> 2 live (of 3): gradient accumulation 2 -> 3, global batch 24 (unchanged),"
        " LR x1.00 (unchanged)"
    )
    local = ElasticPolicy(batch="keep_local", lr_warmup_steps=5)
    line = replica_policy_message(
        plan_replica_batch(local, live_groups=3, **SIZES),
        plan_replica_batch(local, live_groups=2, **SIZES),
        first=False,
        warmup_steps=5,
    )
    assert line.endswith(
        "gradient accumulation 2 (unchanged), global batch 24 -> 16, LR x1.00 -> x0.67 (ramped in over 5 steps)"
    )


def test_the_live_groups_factor_ramps_from_the_factor_in_force_and_composes_with_a_resume():
    rates = ScaledLearningRates()
    rates.scale.resume(
        ResumeDecision(accumulate_grad_batches=1, lr_scale=0.5, global_batch_before=8, global_batch_after=4), step=0
    )
    rates.replica.ramp_to(2 / 3, step=10, warmup_steps=4)
    assert [rates.factor(s) for s in (10, 12, 14, 99)] == pytest.approx([0.5, 0.5 * 5 / 6, 0.5 * 2 / 3, 0.5 * 2 / 3])
    rates.replica.ramp_to(1.0, step=12, warmup_steps=4)  # a group joins mid-ramp: from 5/6 back to 1
    assert [rates.replica.at(s) for s in (12, 14, 16)] == pytest.approx([5 / 6, 11 / 12, 1.0])
    before = rates.replica.state_dict()
    rates.replica.ramp_to(1.0, step=13, warmup_steps=4)  # the same target again: the ramp goes on
    assert rates.replica.state_dict() == before


def test_a_healed_group_takes_the_sources_rates_bitwise():
    def optimizer() -> torch.optim.Optimizer:
        # 0.03 x (2/3) / (2/3) is not 0.03 in float64: a rate recovered by division would differ in the last bit.
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.03)

    source, joiner = ScaledLearningRates(), ScaledLearningRates()
    src_opt, join_opt = optimizer(), optimizer()
    source.attach([src_opt])
    source.replica.ramp_to(2 / 3, step=0, warmup_steps=0)
    source.apply(0)
    joiner.attach([join_opt])
    join_opt.load_state_dict(src_opt.state_dict())  # the heal: new param_group dicts, the source's scaled rate
    joiner.rebind([join_opt], unscaled=source.unscaled(), applied=source.applied)
    joiner.replica.load_state_dict(source.replica.state_dict())
    for s in (1, 2):
        source.apply(s)
        joiner.apply(s)
    assert join_opt.param_groups[0]["lr"] == src_opt.param_groups[0]["lr"] == 0.03 * (2 / 3)
    joiner.replica.ramp_to(1.0, step=3, warmup_steps=0)  # a change after the heal: from the run's own rate
    source.replica.ramp_to(1.0, step=3, warmup_steps=0)
    assert joiner.apply(3) == source.apply(3) == 1.0
    assert join_opt.param_groups[0]["lr"] == src_opt.param_groups[0]["lr"] == 0.03
    with pytest.raises(ValueError, match="2 param groups here, 1 rates received"):
        joiner.rebind([optimizer(), optimizer()], unscaled=[0.03], applied=1.0)


def test_lr_scale_ramp_to_from_a_fresh_scale():
    scale = LRScale()
    scale.ramp_to(0.5, step=3, warmup_steps=0)
    assert (scale.at(2), scale.at(3)) == (0.5, 0.5)


def _fit(policy: ElasticPolicy, *, accumulate: int = 2, lr: float = 0.03):
    """The strategy's elastic resume in a replica group of a 3-group job (no resume), at train start."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from lightning_ft.strategy.elastic_resume import ElasticResume

    resume = ElasticResume(policy=policy, event_log=lambda: None, sizes=lambda: (1, 1, 1, 1, {}))
    resume.use_replica_groups(num_groups=3, num_groups_known=True, min_replicas=1, group_size=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    trainer = SimpleNamespace(
        accumulate_grad_batches=accumulate,
        optimizers=[optimizer],
        global_step=0,
        train_dataloader=DataLoader(range(100), batch_size=4),
    )
    resume.on_train_start(trainer, None)
    return resume, trainer, optimizer


def test_a_membership_change_sets_the_accumulation_and_the_rates_and_a_healed_group_ends_up_with_the_same():
    survivor, trainer, optimizer = _fit(ElasticPolicy(batch="keep_local", lr_warmup_steps=4))
    first = survivor.replica_membership(trainer, 3, 0)
    assert first is not None and (first["accumulate_grad_batches"], first["lr_scale"]) == (2, 1.0)
    assert survivor.replica_membership(trainer, 3, 1) is None  # the same membership (a discarded step): nothing
    lost = survivor.replica_membership(trainer, 2, 5)
    assert lost is not None and (lost["live_groups"], lost["global_batch"], lost["lr_scale"]) == (2, 16, 2 / 3)
    assert lost["lr_scale_now"] == 1.0  # ramped over 4 steps from the factor in force
    for step in (5, 6, 7):  # the optimizer steps (ElasticResume.optimizer_step's apply) while two groups are live
        survivor.rates.apply(step)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03 * (1 - (1 / 3) * 2 / 4))  # 2 of the 4 ramp steps
    # A replacement heals at step 7 (global_step 7 copied with the rest): the state it receives, then the quorum's
    # change 2 -> 3 on both.
    joiner, joiner_trainer, joiner_optimizer = _fit(ElasticPolicy(batch="keep_local", lr_warmup_steps=4))
    joiner_optimizer.load_state_dict(optimizer.state_dict())
    joiner.load_replica_state(joiner_trainer, survivor.replica_state())
    for resume, t in ((survivor, trainer), (joiner, joiner_trainer)):
        assert resume.replica_membership(t, 3, 7) is not None
        resume.rates.apply(7)
    assert joiner_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]  # bitwise
    assert joiner_trainer.accumulate_grad_batches == trainer.accumulate_grad_batches == 2
    assert joiner.rates.replica.state_dict() == survivor.rates.replica.state_dict()


def test_keep_global_sets_the_accumulation_on_the_trainer_and_a_checkpoint_records_the_full_membership():
    resume, trainer, optimizer = _fit(ElasticPolicy())
    resume.replica_membership(trainer, 3, 0)
    assert resume.replica_membership(trainer, 2, 4)["accumulate_grad_batches"] == 3
    assert trainer.accumulate_grad_batches == 3 and optimizer.param_groups[0]["lr"] == 0.03
    metadata = resume.metadata()
    assert metadata["accumulate_grad_batches"] == 2  # the full membership's: what a whole-job restart rescales
    assert metadata["replica_live_groups"] == 2 and metadata["replica_lr_scale_state"]["target"] == 1.0
    # Relaunched whole (a whole-job restart): the membership of the save until the first quorum.
    from pathlib import Path

    restarted, restarted_trainer, _ = _fit(ElasticPolicy())
    restarted.checkpoint_loaded(Path("ckpt"), metadata, load_start_time=0.0, load_end_time=0.0)
    restarted._check_replica_policy(restarted_trainer)
    assert restarted_trainer.accumulate_grad_batches == 3
    assert restarted.replica_membership(restarted_trainer, 2, 4) is None
    assert restarted.replica_membership(restarted_trainer, 3, 4)["accumulate_grad_batches"] == 2


def test_set_up_refuses_three_groups_of_accumulation_one_under_the_default_policy():
    with pytest.raises(ValueError, match=r"ElasticPolicy\(batch='keep_global'\).*at 2 live groups"):
        _fit(ElasticPolicy(), accumulate=1)


def test_a_whole_job_restart_that_also_rescales_multiplies_the_resume_s_factor_and_the_live_groups():
    """Saved by a group of 1 rank while 2 of 3 groups were live under keep_local + linear (the rates carry 2/3);
    relaunched whole with groups of 2 ranks: the resume doubles the full membership's global batch (x2), and the live
    groups' factor goes on from the save's membership (x2/3) until the first quorum brings back three (x1)."""
    from pathlib import Path
    from types import SimpleNamespace

    from torch.utils.data import DataLoader

    from lightning_ft.strategy.elastic_resume import ElasticResume

    policy = ElasticPolicy(batch="keep_local", lr_scaling="linear")
    saved_replica = LRScale()
    saved_replica.ramp_to(2 / 3, step=4, warmup_steps=0)
    metadata = {
        "step": 10,
        "world_size": 1,
        "mesh": {"data_parallel": 1},
        "per_device_batch_size": 4,
        "accumulate_grad_batches": 2,
        "configured_accumulate_grad_batches": 2,
        "lr_scale": 2 / 3,
        "lr_scale_state": LRScale().state_dict(),
        "replica_lr_scale_state": saved_replica.state_dict(),
        "replica_live_groups": 2,
    }
    resume = ElasticResume(policy=policy, event_log=lambda: None, sizes=lambda: (2, 2, 1, 1, {"data_parallel": 2}))
    resume.use_replica_groups(num_groups=3, num_groups_known=True, min_replicas=1, group_size=2)
    resume.checkpoint_loaded(Path("ckpt"), metadata, load_start_time=0.0, load_end_time=0.0)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.03 * (2 / 3))  # as saved
    trainer = SimpleNamespace(
        accumulate_grad_batches=2,
        optimizers=[optimizer],
        global_step=10,
        max_steps=100,
        checkpoint_callbacks=[],
        train_dataloader=DataLoader(range(100), batch_size=4),
    )
    resume.on_train_start(trainer, None)
    assert trainer.accumulate_grad_batches == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03 * 2 * (2 / 3), rel=1e-12)
    assert resume.replica_membership(trainer, 3, 10)["lr_scale_now"] == pytest.approx(2.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03 * 2, rel=1e-12)
    assert resume.metadata()["lr_scale_state"]["target"] == pytest.approx(2.0)  # the resume's part, saved apart
    assert resume.metadata()["replica_lr_scale_state"]["target"] == 1.0
