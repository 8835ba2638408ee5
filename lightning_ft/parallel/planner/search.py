"""The planner's search: every 3D layout of a model on a cluster, ranked by estimated step time.

:func:`plan_parallelism` tries every factorisation of the world size into data x tensor x pipeline, every micro-batch
size and pipeline schedule, checks each with :class:`~lightning_ft.parallel.ParallelConfig` and the batch split, and
estimates it with :mod:`~lightning_ft.parallel.planner.cost_model`. It is a first-order model meant to rule out layouts
that cannot fit and to order the rest; docs/parallelism.md compares its choices with the layouts Megatron-LM published.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_ft.parallel.parallel_config import ParallelConfig
from lightning_ft.parallel.planner.cost_model import (
    RECOMPUTE,
    MemoryEstimate,
    TimeEstimate,
    estimate_memory,
    estimate_time,
)
from lightning_ft.parallel.planner.specs import GIB, ClusterSpec, ModelSpec
from lightning_ft.parallel.schedules import PLANNER_SCHEDULES
from lightning_ft.parallel.validation import divisors

__all__ = ["SCHEDULES", "Plan", "plan_parallelism"]

SCHEDULES = PLANNER_SCHEDULES
"""The pipeline schedules :func:`plan_parallelism` tries by default and accepts: ``"1f1b"`` and ``"gpipe"``."""


@dataclass(kw_only=True, frozen=True)
class Plan:
    """One candidate layout with its estimates; :func:`plan_parallelism` returns them best first.

    Example::

        best = plan_parallelism(model=MODEL_PRESETS["gpt-1.3b"], cluster=ClusterSpec(devices_per_node=8),
                                global_batch=64)[0]
        best.config.mesh_shape, best.micro_batch, best.time_s.total
    """

    config: ParallelConfig
    """The data, tensor and pipeline sizes on the cluster. For a layout the placement rules refuse, it is built with
    ``allow_cross_node_tensor_parallel=True`` and without the model, only to record the sizes; ``reason`` says why."""
    micro_batch: int
    """Sequences per micro-batch on one data-parallel replica."""
    num_microbatches: int
    """Micro-batches per optimizer step per replica: pipeline micro-batches, or gradient accumulation without pp."""
    schedule: str | None
    """``"1f1b"`` or ``"gpipe"``; None without pipeline parallelism."""
    feasible: bool
    """Whether the layout can run: valid sizes, an even batch split, and memory within the device's usable memory."""
    reason: str | None
    """Why it cannot run, when ``feasible`` is False; None otherwise."""
    memory_bytes: MemoryEstimate
    """Memory per device by part."""
    time_s: TimeEstimate
    """Step time by part."""


def plan_parallelism(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    seq_len: int = 2048,
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    schedules: Sequence[str] = SCHEDULES,
    sequence_parallel: bool = False,
    recompute: Literal["none", "selective", "full"] = "none",
    mfu: float = 0.4,
    grad_bytes: int = 4,
    shard_optimizer_state: bool = False,
    overlap_data_parallel: bool = True,
    allow_cross_node_tensor_parallel: bool = False,
) -> list[Plan]:
    """Every (data, tensor, pipeline, micro-batch, schedule) layout of ``model`` on ``cluster``, best first.

    Feasible plans come first, ordered by estimated step time (then memory, then fewer pipeline stages); infeasible
    ones follow with their ``reason``, those needing the least memory first.

    Args:
        model: the model's shape.
        cluster: nodes, links, device memory and peak FLOP/s.
        global_batch: sequences per optimizer step, over all replicas.
        seq_len: tokens per sequence.
        micro_batch_sizes: micro-batch sizes to try.
        schedules: pipeline schedules to try when pp > 1 (``"1f1b"``, ``"gpipe"``).
        sequence_parallel: shard layer norms and dropout along the sequence over the tensor-parallel group.
        recompute: ``"none"``, ``"selective"`` (attention core) or ``"full"`` (whole layers; one more forward pass).
        mfu: model FLOPs utilization the devices sustain on compute, 0 < mfu <= 1.
        grad_bytes: bytes per gradient element, 4 (fp32 accumulation) or 2.
        shard_optimizer_state: shard the optimizer state over data parallel (ZeRO-1).
        overlap_data_parallel: hide the gradient all-reduce behind the backward pass (2/3 of compute), as DDP and
            FSDP do; False charges all of it.
        allow_cross_node_tensor_parallel: consider tensor-parallel groups that span nodes (inter-node link).

    Raises:
        ValueError: on an invalid argument, naming it.
    """
    _check_arguments(global_batch, seq_len, micro_batch_sizes, schedules, recompute, mfu, grad_bytes)
    world = cluster.world_size
    plans = []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for micro_batch in micro_batch_sizes:
                for schedule in schedules if pp > 1 else (None,):
                    plans.append(
                        _plan(
                            model=model,
                            cluster=cluster,
                            tp=tp,
                            pp=pp,
                            micro_batch=micro_batch,
                            schedule=schedule,
                            global_batch=global_batch,
                            seq_len=seq_len,
                            sequence_parallel=sequence_parallel,
                            recompute=recompute,
                            mfu=mfu,
                            grad_bytes=grad_bytes,
                            shard_optimizer_state=shard_optimizer_state,
                            overlap_data_parallel=overlap_data_parallel,
                            allow_cross_node_tensor_parallel=allow_cross_node_tensor_parallel,
                        )
                    )
    feasible = sorted(
        (plan for plan in plans if plan.feasible),
        key=lambda plan: (
            plan.time_s.total,
            plan.memory_bytes.total,
            plan.config.pipeline_parallel_size,
            plan.config.tensor_parallel_size,
        ),
    )
    # The infeasible ones closest to fitting come first: they show what to change.
    infeasible = sorted(
        (plan for plan in plans if not plan.feasible),
        key=lambda plan: (plan.memory_bytes.total, plan.time_s.total),
    )
    return feasible + infeasible


def _check_arguments(
    global_batch: int,
    seq_len: int,
    micro_batch_sizes: Sequence[int],
    schedules: Sequence[str],
    recompute: str,
    mfu: float,
    grad_bytes: int,
) -> None:
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_parallelism({name}={value!r}): must be a positive int")
    if not micro_batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in micro_batch_sizes):
        raise ValueError(f"plan_parallelism(micro_batch_sizes={micro_batch_sizes!r}): must be positive ints")
    if not schedules or any(s not in SCHEDULES for s in schedules):
        raise ValueError(f"plan_parallelism(schedules={schedules!r}): choose from {SCHEDULES}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"plan_parallelism(recompute={recompute!r}): choose from {RECOMPUTE}")
    if not 0 < mfu <= 1:
        raise ValueError(f"plan_parallelism(mfu={mfu!r}): must be in (0, 1]")
    if grad_bytes not in (2, 4):
        raise ValueError(f"plan_parallelism(grad_bytes={grad_bytes!r}): must be 2 or 4")


def _plan(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    tp: int,
    pp: int,
    micro_batch: int,
    schedule: str | None,
    global_batch: int,
    seq_len: int,
    sequence_parallel: bool,
    recompute: str,
    mfu: float,
    grad_bytes: int,
    shard_optimizer_state: bool,
    overlap_data_parallel: bool,
    allow_cross_node_tensor_parallel: bool,
) -> Plan:
    world = cluster.world_size
    dp = world // (tp * pp)
    reason = None
    sizes = dict(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        config = ParallelConfig.for_cluster(
            cluster,
            **sizes,
            allow_cross_node_tensor_parallel=allow_cross_node_tensor_parallel,
            num_heads=model.num_heads,
            num_layers=model.num_layers,
            owner=None,
        )
    except ValueError as error:
        reason = str(error)
        # Still record the layout, so that the table can show what was refused and why.
        config = ParallelConfig.for_cluster(cluster, **sizes, allow_cross_node_tensor_parallel=True, owner=None)
    replicas_batch = dp * micro_batch
    num_microbatches = max(1, global_batch // replicas_batch)
    if reason is None and global_batch % replicas_batch:
        reason = (
            f"global batch {global_batch} does not split into micro-batches of {micro_batch} over "
            f"{dp} data-parallel replicas ({dp} x {micro_batch} = {replicas_batch} does not divide {global_batch})"
        )
    if reason is None and schedule == "1f1b" and num_microbatches < pp:
        reason = f"1F1B needs at least as many micro-batches as stages: {num_microbatches} < {pp}"

    memory = estimate_memory(
        model=model,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        num_microbatches=num_microbatches,
        schedule=schedule,
        seq_len=seq_len,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        grad_bytes=grad_bytes,
        shard_optimizer_state=shard_optimizer_state,
    )
    time = estimate_time(
        model=model,
        cluster=cluster,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=micro_batch,
        num_microbatches=num_microbatches,
        global_batch=global_batch,
        seq_len=seq_len,
        recompute=recompute,
        mfu=mfu,
        gradient_bytes=memory.gradients,
        overlap_data_parallel=overlap_data_parallel,
    )
    if reason is None and memory.total > cluster.usable_memory_bytes:
        reason = (
            f"needs {memory.total / GIB:.1f} GiB per device (parameters {memory.parameters / GIB:.1f}, gradients "
            f"{memory.gradients / GIB:.1f}, optimizer state {memory.optimizer_state / GIB:.1f}, activations "
            f"{memory.activations / GIB:.1f}) but a device has {cluster.usable_memory_bytes / GIB:.1f} GiB usable "
            f"({cluster.device_memory_bytes / GIB:.1f} GiB less {cluster.reserved_memory_bytes / GIB:.1f} reserved)"
        )
    return Plan(
        config=config,
        micro_batch=micro_batch,
        num_microbatches=num_microbatches,
        schedule=schedule,
        feasible=reason is None,
        reason=reason,
        memory_bytes=memory,
        time_s=time,
    )
