"""Decide gradient accumulation and learning-rate scale when a run resumes on another data-parallel size.

Pure arithmetic on the metadata of the checkpoint being restored and the new world; it reads no state and does no
communication, so every rank computes the same :class:`ResumeDecision`. The strategy applies it (sets
``trainer.accumulate_grad_batches``, scales the learning rates) and logs it in the ``resumed`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_ft.elastic.compatible_sizes import compatible_data_parallel_sizes, compatible_world_sizes
from lightning_ft.elastic.elastic_policy import ElasticPolicy


@dataclass(kw_only=True, frozen=True)
class ResumeDecision:
    """What changes on resume. Global batch = per-device batch x data-parallel size x gradient accumulation."""

    accumulate_grad_batches: int
    """Gradient accumulation to train with from now on."""

    lr_scale: float
    """Factor on every learning rate, relative to the run that wrote the checkpoint; 1.0 means unchanged.
    ElasticFT3D multiplies the rates in the optimizer by it (ramped over ``lr_warmup_steps``); LR schedulers keep
    computing their own unscaled schedule underneath."""

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
    new_accumulate: int | None = None,
    new_world_size: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> ResumeDecision:
    """The accumulation and learning-rate scale for resuming a checkpoint with the new run's settings.

    ``new_accumulate`` is an ``accumulate_grad_batches`` the user chose for the new run (``None``: none; the
    strategy passes the new Trainer's when it differs from the user's own setting in the run that saved). A choice
    is never overridden:

    - nothing changed (same data-parallel size, per-device batch and accumulation): nothing is rescaled;
    - ``keep_global``: keeps samples per optimizer step. If the user chose an accumulation, it must give the saved
      global batch with the new per-device batch and data-parallel size; otherwise the accumulation becomes
      ``saved global batch / (new_per_device_batch x new_dp_size)``, which must be whole. The learning rate stays;
    - ``keep_local``: trains with the new per-device batch and the Trainer's accumulation, so the global batch
      follows the data-parallel size (and any batch or accumulation the user changed), and the learning rate
      follows the global batch as ``policy.lr_scaling`` says;
    - ``None``: the data-parallel size must not change; a batch or accumulation the user changed is used as is,
      without rescaling.

    Raises:
        ValueError: ``policy`` is ``None`` and the data-parallel size changed; ``keep_global`` cannot keep the global
            batch (the message lists the data-parallel and world sizes that can, from :func:`compatible_world_sizes`)
            or the user's accumulation contradicts it; a size is not an int >= 1.
    """
    sizes = {
        "saved_world_size": saved_world_size,
        "saved_dp_size": saved_dp_size,
        "saved_per_device_batch": saved_per_device_batch,
        "saved_accumulate": saved_accumulate,
        "new_dp_size": new_dp_size,
        "new_per_device_batch": new_per_device_batch,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    if new_accumulate is not None:
        sizes["new_accumulate"] = new_accumulate
    if new_world_size is not None:
        sizes["new_world_size"] = new_world_size
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_resume({name}={value!r}): must be an int >= 1")

    user_accumulate = saved_accumulate if new_accumulate is None else new_accumulate
    before = saved_per_device_batch * saved_dp_size * saved_accumulate
    as_configured = new_per_device_batch * new_dp_size * user_accumulate
    if (new_dp_size, new_per_device_batch, user_accumulate) == (
        saved_dp_size,
        saved_per_device_batch,
        saved_accumulate,
    ):
        return ResumeDecision(
            accumulate_grad_batches=saved_accumulate,
            lr_scale=1.0,
            global_batch_before=before,
            global_batch_after=before,
        )
    if policy is None:
        if new_dp_size != saved_dp_size:
            now = f"{new_world_size} ranks" if new_world_size is not None else f"a data-parallel size of {new_dp_size}"
            raise ValueError(
                f"resuming a run saved on {saved_world_size} ranks (data-parallel size {saved_dp_size}) on {now}"
                f" (data-parallel size {new_dp_size}) needs elastic=ElasticPolicy(...); it is elastic=None"
            )
        return ResumeDecision(
            accumulate_grad_batches=user_accumulate,
            lr_scale=1.0,
            global_batch_before=before,
            global_batch_after=as_configured,
        )

    saved = (
        f"the saved global batch {before} (per-device batch {saved_per_device_batch} x data-parallel size"
        f" {saved_dp_size} x accumulate {saved_accumulate})"
    )
    if policy.batch == "keep_global":
        if new_accumulate is not None:
            if as_configured != before:
                per_step = new_per_device_batch * new_dp_size
                fits = f"set accumulate_grad_batches={before // per_step}, " if before % per_step == 0 else ""
                raise ValueError(
                    f"ElasticPolicy(batch='keep_global') keeps {saved}, but Trainer(accumulate_grad_batches="
                    f"{user_accumulate}) with per-device batch {new_per_device_batch} x data-parallel size"
                    f" {new_dp_size} gives {as_configured}; {fits}leave accumulate_grad_batches as the saved run had"
                    f" it to let the policy choose, or use ElasticPolicy(batch='keep_local') to train with the new"
                    f" global batch"
                )
            accumulate = user_accumulate
        else:
            per_accumulation_step = new_per_device_batch * new_dp_size
            if before % per_accumulation_step:
                raise ValueError(
                    f"ElasticPolicy(batch='keep_global'): {saved} is not a multiple of per-device batch"
                    f" {new_per_device_batch} x data-parallel size {new_dp_size} = {per_accumulation_step}; use"
                    f" ElasticPolicy(batch='keep_local'){_compatible_hint(before, new_per_device_batch, tensor_parallel_size, pipeline_parallel_size)}"
                )
            accumulate = before // per_accumulation_step
    else:
        accumulate = user_accumulate
    after = new_per_device_batch * new_dp_size * accumulate
    ratio = after / before
    lr_scale = policy.lr_factor(ratio)
    return ResumeDecision(
        accumulate_grad_batches=accumulate,
        lr_scale=lr_scale,
        global_batch_before=before,
        global_batch_after=after,
        lr_warmup_steps=policy.lr_warmup_steps,
    )


def _compatible_hint(global_batch: int, per_device_batch: int, tp: int, pp: int) -> str:
    dp_sizes = compatible_data_parallel_sizes(global_batch=global_batch, per_device_batch=per_device_batch)
    if not dp_sizes:
        return f" or a per-device batch that divides {global_batch}"
    hint = f", or resume on a data-parallel size in {dp_sizes}"
    if tp * pp > 1:
        worlds = compatible_world_sizes(
            global_batch=global_batch,
            per_device_batch=per_device_batch,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        hint += f" (world sizes {worlds} with tensor x pipeline size {tp * pp})"
    return hint + " (lightning_ft.elastic.compatible_world_sizes lists them)"


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
    policy: ElasticPolicy | None,
    metadata: dict[str, Any],
    *,
    new_dp_size: int,
    new_world_size: int,
    new_per_device_batch: int | None = None,
    new_accumulate: int | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> ResumeDecision:
    """:func:`plan_resume` for the metadata of a lightning-ft checkpoint (``world_size``, ``mesh``,
    ``per_device_batch_size``, ``accumulate_grad_batches``) resumed with the new run's settings.

    ``new_per_device_batch`` is the training DataLoader's batch size (``None``: the saved one) and ``new_accumulate``
    an ``accumulate_grad_batches`` the user chose for the new run (``None``: none, see :func:`plan_resume`).
    """
    saved_mesh = metadata.get("mesh") or {}
    saved_world = int(metadata.get("world_size") or new_world_size)
    batch = int(metadata.get("per_device_batch_size") or new_per_device_batch or 1)
    return plan_resume(
        policy,
        saved_world_size=saved_world,
        saved_dp_size=int(saved_mesh.get("data_parallel", saved_world)),
        saved_per_device_batch=batch,
        saved_accumulate=int(metadata.get("accumulate_grad_batches") or 1),
        new_dp_size=new_dp_size,
        new_per_device_batch=batch if new_per_device_batch is None else new_per_device_batch,
        new_accumulate=new_accumulate,
        new_world_size=new_world_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
