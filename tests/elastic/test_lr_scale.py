"""LRScale across any number of resumes, and ScaledLearningRates: the optimizer holds the rate it steps with."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_ft.elastic.internal import LRScale, ResumeDecision, ScaledLearningRates


def decision(lr_scale: float, warmup: int) -> ResumeDecision:
    return ResumeDecision(
        accumulate_grad_batches=1,
        lr_scale=lr_scale,
        global_batch_before=8,
        global_batch_after=int(8 * lr_scale),
        lr_warmup_steps=warmup,
    )


def saved_and_restored(scale: LRScale) -> LRScale:
    restored = LRScale()
    restored.load_state_dict(scale.state_dict())
    return restored


def test_a_ramp_interrupted_by_a_same_size_resume_continues_to_its_target():
    scale = LRScale()
    scale.resume(decision(0.5, 10), step=100)
    assert scale.at(101) == pytest.approx(0.95)
    for stop in (101, 102, 105):  # resumed again, on the same size, before the ramp ended
        scale = saved_and_restored(scale)
        scale.resume(decision(1.0, 10), step=stop)
    assert [scale.at(s) for s in (105, 110, 200)] == pytest.approx([0.75, 0.5, 0.5])


def test_a_second_resize_ramps_from_the_value_reached_to_the_product_of_the_targets():
    scale = LRScale()
    scale.resume(decision(0.5, 4), step=0)
    scale = saved_and_restored(scale)
    scale.resume(decision(4.0, 2), step=2)  # reached 0.75 of the way to 0.5
    assert [scale.at(s) for s in (2, 3, 4, 9)] == pytest.approx([0.75, 1.375, 2.0, 2.0])


def test_a_checkpoint_without_the_ramp_state_holds_its_factor():
    scale = LRScale()
    scale.load_constant(0.9)
    assert scale.at(0) == scale.at(10**6) == 0.9


class _Module:
    """The one hook ScaledLearningRates wraps, as a LightningModule has it."""

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step()


def test_param_groups_show_the_rate_the_step_uses_and_schedulers_keep_their_own_schedule():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # chainable: reads group["lr"]
    module = _Module()
    rates = ScaledLearningRates()
    rates.scale.resume(decision(0.25, 0), step=0)
    rates.attach([optimizer], module=module)
    seen = []
    for step in range(3):
        rates.apply(step)
        seen.append(optimizer.param_groups[0]["lr"])
        module.lr_scheduler_step(scheduler, None)  # Lightning steps the scheduler through this hook
    assert seen == pytest.approx([0.25, 0.125, 0.0625])  # 0.25 x the unscaled 1, 0.5, 0.25
    assert scheduler.get_last_lr() == pytest.approx([0.25 * 0.125])
    rates.detach()
    assert "lr_scheduler_step" not in vars(module)


def test_a_rate_set_by_user_code_is_taken_as_unscaled_and_scaled():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    rates = ScaledLearningRates()
    rates.scale.resume(decision(0.5, 0), step=0)
    rates.attach([optimizer])
    rates.apply(0)
    optimizer.param_groups[0]["lr"] = 0.2  # a manual warm-up in the LightningModule
    rates.apply(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


def test_rates_saved_with_a_factor_are_unscaled_from_it_on_resume():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.75)  # saved while the factor 0.75 was in force
    rates = ScaledLearningRates()
    rates.scale.resume(decision(0.5, 2), step=0)
    rates.scale.start_scale = 0.75  # the ramp as restored: from 0.75 at step 0 to 0.5 at step 2
    rates.attach([optimizer], saved_scale=0.75)
    assert [rates.apply(s) for s in (0, 1, 2)] == pytest.approx([0.75, 0.625, 0.5])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)


def test_the_module_stays_picklable_while_its_scheduler_hook_is_wrapped():
    # neuralforecast keeps Trainer keywords (callbacks that reach the module) in its hyperparameters, pickled at each
    # save: a closure on the module made every such save fail.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    module = _Module()
    rates = ScaledLearningRates()
    rates.attach([optimizer], module=module)
    restored = pickle.loads(pickle.dumps(module))
    assert callable(restored.lr_scheduler_step)
