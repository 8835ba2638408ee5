"""Pipeline-parallel runtime: cuts a module into stages and runs a torch.distributed.pipelining schedule.

A LightningModule takes part in pipeline parallelism by implementing two methods: ``pipeline_blocks()`` returns
its layers in execution order (input to output) and ``pipeline_loss(output, target)`` computes the loss of one
micro-batch. ``training_step`` calls :func:`pipeline_step`, which runs the model and loss directly when there is no
pipeline and runs the schedule (forward, loss and backward of every micro-batch) when the strategy has attached a
:class:`PipelineRunner`. Either way it returns a loss whose ``backward()`` puts the gradients into the parameters, so
Lightning's automatic optimization (zero_grad between ``training_step`` and backward, loss division for gradient
accumulation, precision loss scaling) works unchanged. The runner cuts the module in place: blocks owned by other stages are replaced by
parameter-free placeholders, so ``module.parameters()`` yields only this stage's parameters (what
``configure_optimizers`` sees) and ``module.state_dict()`` keeps the original names (``blocks.2.attn.q.weight``).
Data-parallel gradient averaging stays with the caller (:meth:`PipelineRunner.sync_data_parallel_grads`); tensor
parallelism is applied to the blocks by the user's ``configure_model`` and is invisible here.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from lightning_ft._compat import DTensor
from lightning_ft.parallel.schedules import PIPELINE_SCHEDULES

SCHEDULES: dict[str, type] = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved1f1b": ScheduleInterleaved1F1B,
}
"""The ``torch.distributed.pipelining`` class of each name in :data:`~lightning_ft.parallel.schedules.PIPELINE_SCHEDULES`."""

# Module -> runner attached to it; weak, so that a module never keeps process groups alive through its runner.
_RUNNERS: weakref.WeakKeyDictionary[nn.Module, PipelineRunner] = weakref.WeakKeyDictionary()


class _RemoteBlock(nn.Module):
    """Placeholder left in the module for a block that lives on another pipeline stage. Holds no parameters."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.name = name
        self.stage = stage

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(
            f"{self.name} lives on pipeline stage {self.stage}; with pipeline parallelism call "
            "lightning_ft.parallel.pipeline.pipeline_step(self, inputs, target) instead of the module's forward"
        )

    def extra_repr(self) -> str:
        return f"{self.name!r}, stage={self.stage}"


class _StageModule(nn.Module):
    """Runs one stage's blocks in order. Not registered in the user's module, so its names never reach a checkpoint."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _ReleaseGrads(torch.autograd.Function):
    """Identity on the loss whose backward hands the runner's held gradients to the parameters, scaled by the
    incoming gradient (Lightning's ``1 / accumulate_grad_batches``, a precision plugin's loss scale)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, loss: torch.Tensor, anchor: torch.Tensor, runner: object):
        ctx.runner = runner
        return loss.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        ctx.runner._release_grads(float(grad))
        return None, None, None


def pipeline_step(module: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training (or evaluation) loss of one batch, with or without pipeline parallelism.

    Call it from ``training_step`` / ``validation_step`` on every rank. Without a runner attached it returns
    ``pipeline_loss(module(inputs), target)`` with its autograd graph (running ``pipeline_blocks()`` in order if the
    module defines no ``forward``), so the module trains unchanged under any strategy. Going through ``module(...)``
    matters: hooks on the module itself, such as FSDP2's unsharding of root-level parameters, must run. With a runner attached it is :meth:`PipelineRunner.step`: collective over
    the pipeline group, the same value on every rank, and ``backward()`` on it delivers the stage's gradients.
    """
    runner = _RUNNERS.get(module)
    if runner is not None:
        return runner.step(inputs, target)
    if _defines_forward(module):
        return module.pipeline_loss(module(inputs), target)
    x = inputs
    for block in module.pipeline_blocks():
        x = block(x)
    return module.pipeline_loss(x, target)


def _defines_forward(module: nn.Module) -> bool:
    import lightning.pytorch as pl

    forward = type(module).forward
    return forward is not nn.Module.forward and forward is not pl.LightningModule.forward


class PipelineRunner:
    """Cuts ``module`` into this rank's pipeline stage(s) and runs one schedule step per batch.

    Args:
        module: implements ``pipeline_blocks() -> Sequence[nn.Module]`` (registered submodules, in execution order,
            each taking and returning one tensor) and ``pipeline_loss(output, target) -> Tensor`` (mean over the
            micro-batch). Cut in place by the constructor.
        group: the pipeline-parallel process group (``mesh["pipeline_parallel"].get_group()``); the stage index is
            this rank's rank in it, the stage count its size (times ``stages_per_rank``).
        num_microbatches: micro-batches per batch; the local batch size must be divisible by it.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"``.
        stages_per_rank: stages held by one rank; more than 1 only with ``"interleaved1f1b"`` (rank ``r`` holds
            stages ``r, r + pp, r + 2 pp, ...``).
        device: where the stage runs; defaults to the device of the module's first parameter.

    The constructor is collective over ``group`` only in the sense that every rank of the group must build a runner
    with the same arguments before the first :meth:`step`; it sends nothing itself. Build it after the user's
    ``configure_model`` (tensor parallelism) and before ``configure_optimizers``.

    Raises:
        TypeError: the module lacks ``pipeline_blocks`` or ``pipeline_loss``, or a block is not its submodule.
        ValueError: unknown schedule, blocks not divisible into stages, parameters outside every block, or
            ``num_microbatches`` / ``stages_per_rank`` out of range.

    Example::

        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pipeline_parallel", "data_parallel", "tensor_parallel"))
        runner = PipelineRunner(model, group=mesh["pipeline_parallel"].get_group(), num_microbatches=4)
        optimizer = torch.optim.AdamW(model.parameters())  # this stage's parameters only
        loss = runner.step(tokens, targets)                  # forward + backward of every micro-batch
        loss.backward()                                      # hands the stage's gradients to its parameters
        runner.sync_data_parallel_grads(mesh["data_parallel"].get_group())
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup,
        num_microbatches: int,
        schedule: str = "1f1b",
        stages_per_rank: int = 1,
        device: torch.device | None = None,
    ) -> None:
        for hook in ("pipeline_blocks", "pipeline_loss"):
            if not callable(getattr(module, hook, None)):
                raise TypeError(
                    f"Pipeline parallelism needs {type(module).__name__}.{hook}(); see docs/parallelism.md "
                    "(pipeline_blocks() returns the layers in order, pipeline_loss(output, target) the loss)"
                )
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches}: must be at least 1")
        if stages_per_rank < 1 or (stages_per_rank > 1) != (schedule == "interleaved1f1b"):
            raise ValueError(
                f"stages_per_rank={stages_per_rank} with pipeline_schedule={schedule!r}: "
                "'interleaved1f1b' needs 2 or more stages per rank, the other schedules exactly 1"
            )
        self.module = module
        self.group = group
        self.num_microbatches = num_microbatches
        self._pending_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.schedule_name = schedule
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_stages = self.group_size * stages_per_rank
        self.stage_indices = [self.group_rank + v * self.group_size for v in range(stages_per_rank)]
        # The last stage always sits on the last rank of the group (stage i lives on group rank i % pp).
        self._last_stage_global_rank = dist.get_global_rank(group, (self.num_stages - 1) % self.group_size)

        stage_blocks = self._cut(module)
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device
        self.stages = [
            PipelineStage(_StageModule(stage_blocks[i]), i, self.num_stages, device, group=group)
            for i in self.stage_indices
        ]
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        schedule_cls = SCHEDULES[schedule]
        # scale_grads=False and a loss divided by the micro-batch count: the schedule would otherwise divide every
        # gradient in place after backward, including gradients accumulated from earlier batches.
        self._schedule = schedule_cls(
            self.stages if stages_per_rank > 1 else self.stages[0],
            n_microbatches=num_microbatches,
            loss_fn=self._microbatch_loss,
            scale_grads=False,
        )
        _RUNNERS[module] = self

    @classmethod
    def attached_to(cls, module: nn.Module) -> PipelineRunner | None:
        """The runner cutting ``module``, or None when it is not pipelined."""
        return _RUNNERS.get(module)

    def detach(self) -> None:
        """Stop routing :func:`pipeline_step` through this runner (at teardown). The module stays cut."""
        _RUNNERS.pop(self.module, None)

    def _cut(self, module: nn.Module) -> list[list[nn.Module]]:
        blocks = list(module.pipeline_blocks())
        names = {id(m): name for name, m in module.named_modules(remove_duplicate=False) if name}
        for i, block in enumerate(blocks):
            if id(block) not in names:
                raise TypeError(
                    f"{type(module).__name__}.pipeline_blocks()[{i}] ({type(block).__name__}) is not a registered "
                    "submodule of the module; return modules assigned as attributes (self.embed, *self.blocks, ...)"
                )
            if isinstance(block, _RemoteBlock):
                raise ValueError(f"{type(module).__name__} is already cut into pipeline stages")
        if len(blocks) % self.num_stages:
            raise ValueError(
                f"pipeline_parallel_size={self.group_size}: the {len(blocks)} blocks returned by "
                f"{type(module).__name__}.pipeline_blocks() cannot be split into {self.num_stages} stages of equal "
                f"size; return a number of blocks divisible by {self.num_stages} (for example, fold the embedding into "
                "the first block and the head into the last) or choose another pipeline size"
            )
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        outside = [name for name, p in module.named_parameters() if id(p) not in in_blocks]
        if outside:
            raise ValueError(
                f"{type(module).__name__}: parameters {outside[:5]} are in no block of pipeline_blocks(); every "
                "parameter must belong to exactly one pipeline stage"
            )
        per_stage = len(blocks) // self.num_stages
        stage_blocks = [blocks[s * per_stage : (s + 1) * per_stage] for s in range(self.num_stages)]
        owned = {id(p) for s in self.stage_indices for block in stage_blocks[s] for p in block.parameters()}
        for s, chunk in enumerate(stage_blocks):
            if s in self.stage_indices:
                continue
            for block in chunk:
                if any(id(p) in owned for p in block.parameters()):
                    raise ValueError(
                        f"{names[id(block)]} shares parameters with a block on another stage (tied weights); "
                        "tied weights across pipeline stages are not supported"
                    )
                parent_name, _, child = names[id(block)].rpartition(".")
                module.get_submodule(parent_name).register_module(child, _RemoteBlock(names[id(block)], s))
        return stage_blocks

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.module.pipeline_loss(output, target) / self.num_microbatches

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Run forward, loss and (when grad is enabled) backward for every micro-batch of one batch.

        Collective over the pipeline group: every rank of it calls once per batch, each with the same ``inputs``
        and ``target`` (the first stage reads ``inputs``, the last ``target``). The schedule's gradients are held by
        the runner until ``backward()`` is called on the returned loss, which adds them to the stage's parameters'
        ``.grad`` multiplied by the incoming gradient (``(loss / k).backward()`` adds a k-th), exactly as if the loss
        had been computed in one graph; a loss never backpropagated drops them at the next step. The caller then
        averages over data parallel (:meth:`sync_data_parallel_grads`), steps the optimizer and zeroes the gradients.
        Under ``torch.no_grad()`` or inference mode only forward and loss run.

        Returns:
            The batch loss (mean of the micro-batch losses), a 0-dim float tensor with the same value on every rank
            of the group; with grad enabled it requires grad (its graph ends at the runner, not the parameters).

        Raises:
            ValueError: the batch size is not divisible by ``num_microbatches``.
        """
        batch = inputs.shape[0]
        if batch % self.num_microbatches:
            raise ValueError(
                f"num_microbatches={self.num_microbatches}: does not divide the per-device batch size {batch}"
            )
        args = (inputs.to(self.device),) if self.is_first else ()
        tgt = target.to(self.device) if self.is_last else None
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        training = torch.is_grad_enabled()
        if training:
            self._run_and_hold_grads(args, tgt, losses)
        else:
            self._schedule.eval(*args, target=tgt, losses=losses, return_outputs=False)
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self._last_stage_global_rank, group=self.group)
        if not training:
            return loss
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        return _ReleaseGrads.apply(loss, anchor, self)

    def _run_and_hold_grads(self, args: tuple, target: torch.Tensor | None, losses: list | None) -> None:
        # The schedule runs backward inside step(), but Lightning zeroes gradients between training_step and
        # backward. So the step's gradients are held aside, the earlier ones put back, and the held ones added when
        # the returned loss is backpropagated, after any zero_grad.
        params = [p for stage in self.stages for p in stage.submod.parameters() if p.requires_grad]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
            for p, g in zip(params, earlier, strict=True):
                p.grad = g

    def _release_grads(self, scale: float) -> None:
        pending, self._pending_grads = self._pending_grads, []
        for p, g in pending:
            if scale != 1.0:
                g.mul_(scale)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def sync_data_parallel_grads(self, group: dist.ProcessGroup | None) -> None:
        """Average the stage's gradients over the data-parallel ``group`` (all-reduce, works on gloo and NCCL).

        Collective over ``group``: every rank of it calls once per optimizer step, after the last :meth:`step` of the
        accumulation window and before ``optimizer.step()``. DTensor gradients (tensor parallelism) are averaged
        shard by shard. A ``None`` group or a group of one rank is a no-op.
        """
        if group is None or dist.get_world_size(group) == 1:
            return
        grads = []
        for p in self.module.parameters():
            if p.grad is not None:
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        size = dist.get_world_size(group)
        for same in by_dtype.values():
            # One flat buffer per dtype: one collective instead of one per parameter. gloo has no AVG, so SUM / size.
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(size)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model (every stage) to a total norm of ``max_norm``; returns that norm.

        Lightning's ``gradient_clip_val`` would measure only this stage's gradients. Collective over the pipeline
        group and, for DTensor gradients, their tensor-parallel group: every rank calls it once per optimizer step,
        after :meth:`sync_data_parallel_grads` (so the data-parallel replicas agree) and before ``optimizer.step()``.
        """
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        # One norm per group: torch's foreach norm refuses lists that mix DTensors and tensors, or DTensor layouts.
        norms = [torch.nn.utils.get_total_norm(plain, norm_type)] if plain else []
        norms += [torch.linalg.vector_norm(g, norm_type).full_tensor() for g in grads if isinstance(g, DTensor)]
        local = torch.stack(norms).to(self.device) if norms else torch.zeros(1, device=self.device)
        if norm_type == float("inf"):
            total = local.max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = (local**norm_type).sum()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
            total = total ** (1.0 / norm_type)
        coef = max_norm / (total.item() + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total
