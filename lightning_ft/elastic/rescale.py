"""Decide gradient accumulation and learning-rate scale when a run resumes on another data-parallel size.

Pure arithmetic on the metadata of the checkpoint being restored and the new world; it reads no state and does no
communication, so every rank computes the same :class:`ResumeDecision`. The strategy applies it (sets
``trainer.accumulate_grad_batches``, scales the learning rates) and logs it in the ``resumed`` event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_ft.elastic.elastic_policy import ElasticPolicy
from lightning_ft.parallel.validation import divisors


@dataclass(kw_only=True, frozen=True)
class ResumeDecision:
    """What changes on resume. Global batch = per-device batch x data-parallel size x gradient accumulation."""

    accumulate_grad_batches: int
    """Gradient accumulation to train with from now on."""

    lr_scale: float
    """Factor on every learning rate, relative to the run that wrote the checkpoint; 1.0 means unchanged.
    ElasticFT3D applies it around each optimizer step, so LR schedulers keep their own unscaled schedule."""

    global_batch_before: int
    """Samples per optimizer step in the run that wrote the checkpoint."""

    global_batch_after: int
    """Samples per optimizer step from now on."""

    lr_warmup_steps: int = 0
    """Optimizer steps over which ``lr_scale`` is ramped in; 0 applies it at once."""

    def lr_scale_at(self, steps_since_resume: int) -> float:
        """The learning-rate scale of this decision ``steps_since_resume`` optimizer steps after the resume.

        Ramps linearly from 1.0 at the resume to ``lr_scale`` after ``lr_warmup_steps`` steps.
        """
        if self.lr_warmup_steps <= 0 or steps_since_resume >= self.lr_warmup_steps:
            return self.lr_scale
        fraction = max(steps_since_resume, 0) / self.lr_warmup_steps
        return 1.0 + (self.lr_scale - 1.0) * fraction


def plan_resume(
    policy: ElasticPolicy | None,
    *,
    saved_world_size: int,
    saved_dp_size: int,
    saved_per_device_batch: int,
    saved_accumulate: int,
    new_dp_size: int,
    new_per_device_batch: int,
    new_world_size: int | None = None,
) -> ResumeDecision:
    """The accumulation and learning-rate scale for resuming a checkpoint on ``new_dp_size`` data-parallel ranks.

    ``keep_global`` keeps samples per optimizer step: accumulation becomes
    ``saved_accumulate * saved_dp_size * saved_per_device_batch / (new_dp_size * new_per_device_batch)``.
    ``keep_local`` keeps the accumulation, so the global batch changes and the learning rate follows it as
    ``policy.lr_scaling`` says. On the same data-parallel size nothing is rescaled, whatever the policy.

    Raises:
        ValueError: if ``policy`` is ``None`` and the data-parallel size changed; if ``keep_global`` cannot keep the
            global batch with a whole accumulation; if a size is not a positive int.
    """
    sizes = {
        "saved_world_size": saved_world_size,
        "saved_dp_size": saved_dp_size,
        "saved_per_device_batch": saved_per_device_batch,
        "saved_accumulate": saved_accumulate,
        "new_dp_size": new_dp_size,
        "new_per_device_batch": new_per_device_batch,
    }
    if new_world_size is not None:
        sizes["new_world_size"] = new_world_size
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_resume({name}={value!r}): must be an int >= 1")

    before = saved_per_device_batch * saved_dp_size * saved_accumulate
    if new_dp_size == saved_dp_size:
        after = new_per_device_batch * new_dp_size * saved_accumulate
        return ResumeDecision(
            accumulate_grad_batches=saved_accumulate, lr_scale=1.0, global_batch_before=before, global_batch_after=after
        )
    if policy is None:
        now = f"{new_world_size} ranks" if new_world_size is not None else f"a data-parallel size of {new_dp_size}"
        raise ValueError(
            f"resuming a run saved on {saved_world_size} ranks (data-parallel size {saved_dp_size}) on {now}"
            f" (data-parallel size {new_dp_size}) needs elastic=ElasticPolicy(...); it is elastic=None"
        )

    if policy.batch == "keep_global":
        per_accumulation_step = new_per_device_batch * new_dp_size
        if before % per_accumulation_step:
            # Data-parallel sizes that would work with this per-device batch: the divisors of before / batch.
            compatible = divisors(before // new_per_device_batch) if before % new_per_device_batch == 0 else []
            hint = f" or a data-parallel size in {compatible}" if compatible else ""
            raise ValueError(
                f"ElasticPolicy(batch='keep_global'): the saved global batch {before} (per-device batch"
                f" {saved_per_device_batch} x data-parallel size {saved_dp_size} x accumulate {saved_accumulate}) is"
                f" not a multiple of per-device batch {new_per_device_batch} x data-parallel size {new_dp_size} ="
                f" {per_accumulation_step}; use ElasticPolicy(batch='keep_local'){hint}"
            )
        accumulate = before // per_accumulation_step
    else:
        accumulate = saved_accumulate
    after = new_per_device_batch * new_dp_size * accumulate
    ratio = after / before
    lr_scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[policy.lr_scaling]
    return ResumeDecision(
        accumulate_grad_batches=accumulate,
        lr_scale=lr_scale,
        global_batch_before=before,
        global_batch_after=after,
        lr_warmup_steps=policy.lr_warmup_steps,
    )


def check_accumulation_scheduler(trainer: Any, policy: ElasticPolicy | None) -> None:
    """Refuse a ``GradientAccumulationScheduler`` callback together with ``ElasticPolicy(batch="keep_global")``.

    Both set ``trainer.accumulate_grad_batches``: the scheduler at every epoch start, the policy on resume, so one
    would silently undo the other. Call it at setup, on every rank (no communication).

    Raises:
        ValueError: naming the callback and the two ways out.
    """
    if policy is None or policy.batch != "keep_global":
        return
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, GradientAccumulationScheduler):
            raise ValueError(
                f"ElasticPolicy(batch='keep_global') changes gradient accumulation on resume and cannot be combined"
                f" with the {type(callback).__name__} callback; remove the callback or use"
                f" ElasticPolicy(batch='keep_local')"
            )


def plan_resume_from_metadata(
    policy: ElasticPolicy | None, metadata: dict[str, Any], *, new_dp_size: int, new_world_size: int
) -> ResumeDecision:
    """:func:`plan_resume` for the metadata of a lightning-ft checkpoint (``world_size``, ``mesh``,
    ``per_device_batch_size``, ``accumulate_grad_batches``) resumed on ``new_dp_size`` data-parallel ranks.

    The new per-device batch is the dataloader's, known only once data is set up; until the batch policy can change
    it, it equals the saved one.
    """
    saved_mesh = metadata.get("mesh") or {}
    saved_world = int(metadata.get("world_size") or new_world_size)
    batch = int(metadata.get("per_device_batch_size") or 1)
    return plan_resume(
        policy,
        saved_world_size=saved_world,
        saved_dp_size=int(saved_mesh.get("data_parallel", saved_world)),
        saved_per_device_batch=batch,
        saved_accumulate=int(metadata.get("accumulate_grad_batches") or 1),
        new_dp_size=new_dp_size,
        new_per_device_batch=batch,
        new_world_size=new_world_size,
    )
