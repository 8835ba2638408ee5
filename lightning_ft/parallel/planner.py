"""A planner that ranks 3D-parallel layouts of a GPT-style model on a cluster by estimated step time.

:func:`plan_parallelism` tries every factorisation of the world size into data x tensor x pipeline, every micro-batch
size and pipeline schedule, and estimates for each the memory per device (parameters, gradients, optimizer state and
activations, after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models") and the
step time (compute, tensor-parallel all-reduces on the intra-node link, the pipeline bubble, the data-parallel gradient
all-reduce on the inter-node link). It is a first-order model meant to rule out layouts that cannot fit and to order the
rest; docs/parallelism.md compares its choices with the layouts Megatron-LM published.

Bytes per parameter: mixed-precision Adam as Megatron-LM runs it: 2 for the bf16 weights, ``grad_bytes`` (4: fp32
gradient accumulation, or 2) for the gradients, 12 for the optimizer state (fp32 master weights, Adam's two moments),
divided by the data-parallel size when ``shard_optimizer_state=True`` (ZeRO-1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_ft.parallel.parallel_config import ClusterShape, ParallelConfig

GIB = 2**30
WEIGHT_BYTES = 2
"""bf16 weights."""
OPTIMIZER_STATE_BYTES = 12
"""fp32 master weights, Adam's first and second moments."""
SCHEDULES = ("1f1b", "gpipe")
RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The shape of a GPT-style decoder: what the planner needs to count parameters, activations and FLOPs.

    Parameters are counted as Megatron-LM's GPT has them: per layer ``4h^2 + 2hf`` weights plus biases and two layer
    norms, a word embedding of ``vocab_size x h`` tied with the output layer, a final layer norm; no learned position
    embedding.

    Example::

        model = ModelSpec(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50257)
        model.num_parameters  # about 1.31e9
    """

    name: str = "custom"
    """Label shown in tables."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads a; must divide ``hidden_size``."""
    vocab_size: int = 50257
    """Vocabulary size v."""
    ffn_hidden_size: int | None = None
    """Width of the MLP's inner layer f. None: ``4 * hidden_size``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec({name}={value!r}): must be a positive int")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 1):
            raise ValueError(f"ModelSpec(ffn_hidden_size={self.ffn_hidden_size!r}): must be a positive int or None")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSpec(hidden_size={self.hidden_size}, num_heads={self.num_heads}): "
                f"{self.num_heads} heads do not divide the hidden size {self.hidden_size}"
            )

    @property
    def ffn_size(self) -> int:
        """The MLP's inner width f."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def layer_parameters(self, tensor_parallel_size: int = 1) -> float:
        """Parameters of one transformer layer held by one of ``tensor_parallel_size`` devices.

        The QKV, attention-output and MLP weights and the column-parallel biases are split; the row-parallel biases
        and layer norms (6h) are replicated, as in Megatron-LM.
        """
        h, f = self.hidden_size, self.ffn_size
        split = 4 * h * h + 2 * h * f + 3 * h + f
        return split / tensor_parallel_size + 6 * h

    def embedding_parameters(self, tensor_parallel_size: int = 1) -> float:
        """Word-embedding parameters on one device of a vocabulary-parallel embedding."""
        return self.vocab_size * self.hidden_size / tensor_parallel_size

    @property
    def num_parameters(self) -> int:
        """Total parameters: layers, tied word embedding and final layer norm."""
        return round(self.num_layers * self.layer_parameters() + self.embedding_parameters() + 2 * self.hidden_size)


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # GPT-3 family shapes (Brown et al. 2020, Table 2.1) with the GPT-2 vocabulary.
        ModelSpec(name="gpt-125m", num_layers=12, hidden_size=768, num_heads=12),
        ModelSpec(name="gpt-350m", num_layers=24, hidden_size=1024, num_heads=16),
        ModelSpec(name="gpt-1.3b", num_layers=24, hidden_size=2048, num_heads=16),
        ModelSpec(name="gpt-2.7b", num_layers=32, hidden_size=2560, num_heads=32),
        ModelSpec(name="gpt-7b", num_layers=32, hidden_size=4096, num_heads=32),
        ModelSpec(name="gpt-13b", num_layers=40, hidden_size=5120, num_heads=40),
        ModelSpec(name="gpt-175b", num_layers=96, hidden_size=12288, num_heads=96, vocab_size=51200),
        # Megatron-LM's weak-scaling models (Narayanan et al. 2021, Table 1), vocabulary 51200.
        ModelSpec(name="megatron-1.7b", num_layers=24, hidden_size=2304, num_heads=24, vocab_size=51200),
        ModelSpec(name="megatron-18b", num_layers=40, hidden_size=6144, num_heads=48, vocab_size=51200),
        ModelSpec(name="megatron-39b", num_layers=48, hidden_size=8192, num_heads=64, vocab_size=51200),
        ModelSpec(name="megatron-146b", num_layers=80, hidden_size=12288, num_heads=96, vocab_size=51200),
    )
}
"""Model shapes by name, for ``lightning-ft plan --model``."""


@dataclass(kw_only=True, frozen=True)
class ClusterSpec(ClusterShape):
    """A cluster for planning: its shape and links plus what one device can hold and compute.

    Defaults describe H100 SXM 80 GB nodes with NVLink inside a node and one 400 Gb/s InfiniBand adapter per GPU.

    Example::

        cluster = ClusterSpec(num_nodes=4, devices_per_node=8)
        a100 = ClusterSpec(num_nodes=4, devices_per_node=8, **DEVICE_PRESETS["a100-80gb"])
    """

    device_memory_bytes: float = 80 * GIB
    """Memory of one device, bytes."""
    reserved_memory_bytes: float = 4 * GIB
    """Memory the model cannot use (CUDA context, communication buffers, allocator fragmentation), bytes."""
    peak_flops: float = 989e12
    """Peak dense bf16 throughput of one device, FLOP/s."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("device_memory_bytes", "peak_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ClusterSpec({name}={value!r}): must be a positive number")
        if not 0 <= self.reserved_memory_bytes < self.device_memory_bytes:
            raise ValueError(
                f"ClusterSpec(reserved_memory_bytes={self.reserved_memory_bytes!r}): must be at least 0 and below "
                f"device_memory_bytes={self.device_memory_bytes!r}"
            )

    @property
    def usable_memory_bytes(self) -> float:
        """Memory per device the model may use: ``device_memory_bytes - reserved_memory_bytes``."""
        return self.device_memory_bytes - self.reserved_memory_bytes


DEVICE_PRESETS: dict[str, dict[str, float]] = {
    "h100-80gb": dict(
        device_memory_bytes=80 * GIB,
        peak_flops=989e12,
        intra_node_bandwidth_bytes_per_s=450e9,
        inter_node_bandwidth_bytes_per_s=50e9,
    ),
    # DGX A100 as in Megatron-LM's runs: NVSwitch 300 GB/s per direction, one 200 Gb/s HDR adapter per GPU.
    "a100-80gb": dict(
        device_memory_bytes=80 * GIB,
        peak_flops=312e12,
        intra_node_bandwidth_bytes_per_s=300e9,
        inter_node_bandwidth_bytes_per_s=25e9,
    ),
    "a100-40gb": dict(
        device_memory_bytes=40 * GIB,
        peak_flops=312e12,
        intra_node_bandwidth_bytes_per_s=300e9,
        inter_node_bandwidth_bytes_per_s=25e9,
    ),
}
"""Per-device figures by name, for ``ClusterSpec(**DEVICE_PRESETS[name], ...)`` and ``lightning-ft plan --device``."""


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
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
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

    memory = _memory(
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
    time = _time(
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


def _memory(
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
    """Memory of the busiest stage: the first (most micro-batches in flight) or the last (output layer and loss)."""
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


def _time(
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
