"""The planner's cost model: memory per device and step time of one 3D layout, to first order.

Memory counts parameters, gradients, optimizer state and activations on the busiest pipeline stage, activations after
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models". Time counts compute at an
assumed model FLOPs utilization, tensor-parallel all-reduces on the intra-node link, the pipeline bubble, and the part of
the data-parallel gradient all-reduce not hidden behind backward. :func:`~lightning_ft.parallel.plan_parallelism` calls
:func:`estimate_memory` and :func:`estimate_time` for every layout it tries.

Bytes per parameter: mixed-precision Adam as Megatron-LM runs it: 2 for the bf16 weights, ``grad_bytes`` (4: fp32
gradient accumulation, or 2) for the gradients, 12 for the optimizer state (fp32 master weights, Adam's two moments),
divided by the data-parallel size when ``shard_optimizer_state=True`` (ZeRO-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_ft.parallel.planner.specs import ClusterSpec, ModelSpec

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "RECOMPUTE",
    "WEIGHT_BYTES",
    "MemoryEstimate",
    "TimeEstimate",
    "activation_bytes_per_layer",
    "estimate_memory",
    "estimate_time",
]

WEIGHT_BYTES = 2
"""bf16 weights."""
OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam's first and second moments."""
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation modes: none, the attention core (selective), or whole layers (full)."""


@dataclass(kw_only=True, frozen=True)
class MemoryEstimate:
    """Bytes one device holds during a step, by part (the busiest pipeline stage)."""

    parameters: float
    """bf16 weights."""
    gradients: float
    """Gradients (fp32 accumulation unless ``grad_bytes=2``)."""
    optimizer_state: float
    """fp32 master weights and Adam moments, divided by dp with ZeRO-1."""
    activations: float
    """Activations kept for backward, for every micro-batch in flight."""

    @property
    def total(self) -> float:
        """Sum of the parts."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations


@dataclass(kw_only=True, frozen=True)
class TimeEstimate:
    """Seconds of one optimizer step, by part."""

    compute: float
    """Model FLOPs at the assumed utilization, spread over every device."""
    tensor_parallel: float
    """Tensor-parallel all-reduces (or all-gathers and reduce-scatters) of activations."""
    pipeline_bubble: float
    """Idle time of a stage while the pipeline fills and drains: ``compute * (p - 1) / m``."""
    data_parallel: float
    """Gradient all-reduce not hidden behind the backward pass."""

    @property
    def total(self) -> float:
        """Sum of the parts: the estimated step time."""
        return self.compute + self.tensor_parallel + self.pipeline_bubble + self.data_parallel


def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch: int,
    hidden_size: int,
    num_heads: int,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch and device (Korthikanti et al. 2022).

    With s, b, h, a, t the sequence length, micro-batch, hidden size, heads and tensor-parallel size: ``sbh(10 + 24/t +
    5as/(ht))`` with tensor parallelism (``sbh(34 + 5as/h)`` at t = 1), ``sbh/t (34 + 5as/h)`` with sequence parallelism;
    selective recomputation drops the ``5as/h`` attention term; full recomputation keeps only the layer input,
    ``2sbh`` (``2sbh/t`` with sequence parallelism).
    """
    s, b, h, a, t = seq_len, micro_batch, hidden_size, num_heads, tensor_parallel_size
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


def estimate_memory(
    *,
    model: ModelSpec,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    num_microbatches: int,
    schedule: str | None,
    seq_len: int,
    sequence_parallel: bool,
    recompute: str,
    grad_bytes: int,
    shard_optimizer_state: bool,
) -> MemoryEstimate:
    """Bytes per device of the busiest stage of a ``dp x tp x pp`` layout, by part: the first stage (most
    micro-batches in flight under 1F1B) or the last (output layer and loss). ``schedule`` is ``"1f1b"``, ``"gpipe"``
    or None without pipeline parallelism; the other arguments are :func:`~lightning_ft.parallel.plan_parallelism`'s."""
    h, v = model.hidden_size, model.vocab_size
    layers = math.ceil(model.num_layers / pp)
    per_layer = activation_bytes_per_layer(
        seq_len=seq_len,
        micro_batch=micro_batch,
        hidden_size=h,
        num_heads=model.num_heads,
        tensor_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    # Full recomputation rebuilds one layer's activations at a time during backward.
    working = 0.0
    if recompute == "full":
        working = activation_bytes_per_layer(
            seq_len=seq_len,
            micro_batch=micro_batch,
            hidden_size=h,
            num_heads=model.num_heads,
            tensor_parallel_size=tp,
            sequence_parallel=sequence_parallel,
        )
    # Output layer norm, vocabulary-parallel logits and the fp32 cross-entropy: 4sbh/t (1 + v/h) (Korthikanti, 4.3).
    output = 4 * seq_len * micro_batch * h / tp * (1 + v / h)
    stage_params = layers * model.layer_parameters(tp) + model.embedding_parameters(tp)
    if pp == 1:
        # One stage holds everything: embedding (tied with the output layer), final norm, one micro-batch.
        stages = [(stage_params + 2 * h, layers * per_layer + output)]
    else:
        # The first stage holds the word embedding and, under 1F1B, up to p micro-batches in flight; the last stage
        # holds the tied copy for the output layer, the final norm and one micro-batch (GPipe: all m on every stage).
        first_in_flight = num_microbatches if schedule == "gpipe" else min(pp, num_microbatches)
        last_in_flight = num_microbatches if schedule == "gpipe" else 1
        stages = [
            (stage_params, first_in_flight * layers * per_layer),
            (stage_params + 2 * h, last_in_flight * (layers * per_layer + output)),
        ]
    estimates = []
    for params, activations in stages:
        optimizer = OPTIMIZER_STATE_BYTES * params / (dp if shard_optimizer_state else 1)
        estimates.append(
            MemoryEstimate(
                parameters=WEIGHT_BYTES * params,
                gradients=grad_bytes * params,
                optimizer_state=optimizer,
                activations=activations + working,
            )
        )
    return max(estimates, key=lambda estimate: estimate.total)


def estimate_time(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    num_microbatches: int,
    global_batch: int,
    seq_len: int,
    recompute: str,
    mfu: float,
    gradient_bytes: float,
    overlap_data_parallel: bool,
) -> TimeEstimate:
    """Seconds of one optimizer step of a ``dp x tp x pp`` layout on ``cluster``, by part. ``gradient_bytes`` is the
    gradient memory of one device (:attr:`MemoryEstimate.gradients`), all-reduced over data parallel; the other
    arguments are :func:`~lightning_ft.parallel.plan_parallelism`'s."""
    world = cluster.world_size
    # 2 FLOPs per parameter per token forward, 4 backward; full recomputation adds a forward pass.
    flops_per_token = (8 if recompute == "full" else 6) * model.num_parameters
    compute = flops_per_token * global_batch * seq_len / (world * cluster.peak_flops * mfu)
    # (p - 1) idle slots of one micro-batch each, against m busy ones: the bubble is (p-1)/(m+p-1) of the total.
    bubble = compute * (pp - 1) / num_microbatches
    tensor_parallel = 0.0
    if tp > 1:
        # Per layer two all-reduces forward and two backward (three forward passes' worth with full recomputation),
        # each of the layer's bf16 activations, s*b*h*2 bytes, over a ring: 2(t-1)/t of it crosses each link.
        collectives = 6 if recompute == "full" else 4
        link = cluster.intra_node_bandwidth_bytes_per_s
        if cluster.devices_per_node % tp:
            link = cluster.inter_node_bandwidth_bytes_per_s
        per_collective = 2 * (tp - 1) / tp * seq_len * micro_batch * model.hidden_size * 2 / link
        layers = math.ceil(model.num_layers / pp)
        tensor_parallel = num_microbatches * layers * collectives * per_collective
    data_parallel = 0.0
    if dp > 1:
        # A data-parallel group spans dp * tp consecutive ranks; it uses the intra-node link only inside one node.
        inside_node = cluster.devices_per_node % (dp * tp) == 0
        link = cluster.intra_node_bandwidth_bytes_per_s if inside_node else cluster.inter_node_bandwidth_bytes_per_s
        data_parallel = 2 * (dp - 1) / dp * gradient_bytes / link
        if overlap_data_parallel:
            data_parallel = max(0.0, data_parallel - compute * 2 / 3)
    return TimeEstimate(
        compute=compute, tensor_parallel=tensor_parallel, pipeline_bubble=bubble, data_parallel=data_parallel
    )
