"""The validated 3D-parallel configuration: data x tensor x pipeline sizes on a cluster of nodes.

:class:`ParallelConfig` is what ``ElasticFT3D`` and the planner agree on. It checks a request before any process group
exists (sizes multiply to the world size, tensor-parallel groups stay inside a node, the model's heads and layers
divide evenly) and raises errors that name the option as the user typed it, then maps every global rank to its
``(pipeline, data, tensor)`` coordinate in Megatron-LM's order (see :mod:`lightning_ft.parallel.layout`).
:class:`ClusterShape` describes the nodes and the two links whose speed decides where tensor parallelism may go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_ft.parallel import layout

NVLINK_BANDWIDTH_BYTES_PER_S = 450e9
"""Intra-node link, per device and direction: NVLink 4 on an H100 SXM (18 links x 25 GB/s)."""
INFINIBAND_BANDWIDTH_BYTES_PER_S = 50e9
"""Inter-node link, per device and direction: one 400 Gb/s InfiniBand NDR adapter per GPU."""


def _check_positive_int(owner: str | None, name: str, value: Any, *, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        expected = 'a positive int or "auto"' if allow_auto else "a positive int"
        raise TypeError(f"{_call(owner, **{name: value})}: expected {expected}, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{_call(owner, **{name: value})}: must be at least 1")


def _check_bandwidths(owner: str | None, obj: Any) -> None:
    for name in ("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s"):
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{_call(owner, **{name: value})}: must be a positive number of bytes per second")


def _call(owner: str | None, **options: Any) -> str:
    """Render options the way the user typed them: ``ElasticFT3D(tensor_parallel_size=3)``."""
    rendered = ", ".join(f"{name}={value!r}" for name, value in options.items())
    return f"{owner}({rendered})" if owner else rendered


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(kw_only=True, frozen=True)
class ClusterShape:
    """The nodes of a cluster and the speed of the two links that decide where each parallel axis may go.

    Example::

        shape = ClusterShape(num_nodes=4, devices_per_node=8)
        shape.world_size  # 32
    """

    num_nodes: int = 1
    """Number of nodes (machines); torchrun's ``--nnodes``."""
    devices_per_node: int
    """Accelerators (processes) per node; torchrun's ``--nproc-per-node``."""
    intra_node_bandwidth_bytes_per_s: float = NVLINK_BANDWIDTH_BYTES_PER_S
    """Bandwidth between two devices of one node, per device and direction, in bytes per second."""
    inter_node_bandwidth_bytes_per_s: float = INFINIBAND_BANDWIDTH_BYTES_PER_S
    """Bandwidth from one device to another node, per device and direction, in bytes per second."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive_int(owner, "num_nodes", self.num_nodes)
        _check_positive_int(owner, "devices_per_node", self.devices_per_node)
        _check_bandwidths(owner, self)

    @property
    def world_size(self) -> int:
        """Total number of devices: ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Data, tensor and pipeline sizes on a cluster, validated, with the rank layout.

    After construction every size is an int: ``"auto"`` is resolved. Ranks are laid out in Megatron-LM's order:
    tensor-parallel groups are consecutive ranks inside one node, pipeline stages are the outermost axis, data parallel
    sits in between. Ranks of one tensor-parallel or pipeline group see the same batch; the data-parallel coordinate
    (``coordinates(rank)[1]``) picks the batch.

    Example::

        config = ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2, num_nodes=2, devices_per_node=8)
        config.data_parallel_size            # 2
        config.coordinates(13)               # (1, 1, 1): stage 1, data-parallel replica 1, tensor shard 1
        config.ranks_of_group("tensor_parallel", 13)  # [12, 13, 14, 15]

    Raises:
        TypeError: if a size is not an int (or ``"auto"`` where allowed).
        ValueError: if the sizes do not multiply to the world size, a tensor-parallel group would cross a node (unless
            ``allow_cross_node_tensor_parallel=True``), or the model's heads or layers do not divide evenly.
    """

    data_parallel_size: int | Literal["auto"] | None = "auto"
    """Data-parallel replicas. ``"auto"`` (or None): world size / (tensor x pipeline)."""
    tensor_parallel_size: int | Literal["auto"] = 1
    """Devices that shard each layer. ``"auto"``: the devices per node, as in Lightning's ModelParallelStrategy."""
    pipeline_parallel_size: int = 1
    """Pipeline stages; 1 means no pipelining."""
    num_nodes: int = 1
    """Number of nodes; the world size is ``num_nodes * devices_per_node``."""
    devices_per_node: int
    """Devices (processes) per node."""
    allow_cross_node_tensor_parallel: bool = False
    """Accept tensor-parallel groups that span nodes, and their slow inter-node all-reduces."""
    num_heads: int | None = None
    """Attention heads of the model, if known: must divide by ``tensor_parallel_size``. None: not checked."""
    num_layers: int | None = None
    """Transformer layers of the model, if known: must divide by ``pipeline_parallel_size``. None: not checked."""
    intra_node_bandwidth_bytes_per_s: float = NVLINK_BANDWIDTH_BYTES_PER_S
    """Intra-node link per device, bytes per second; used to word the cross-node error."""
    inter_node_bandwidth_bytes_per_s: float = INFINIBAND_BANDWIDTH_BYTES_PER_S
    """Inter-node link per device, bytes per second; used to word the cross-node error."""
    owner: str | None = field(default="ParallelConfig", compare=False, repr=False)
    """Name that prefixes error messages, e.g. ``"ElasticFT3D"``; None: options only."""

    def __post_init__(self) -> None:
        owner = self.owner
        # Checking the cluster first makes every later message able to quote the world size.
        _check_positive_int(owner, "num_nodes", self.num_nodes)
        _check_positive_int(owner, "devices_per_node", self.devices_per_node)
        _check_bandwidths(owner, self)
        if self.data_parallel_size is not None:
            _check_positive_int(owner, "data_parallel_size", self.data_parallel_size, allow_auto=True)
        _check_positive_int(owner, "tensor_parallel_size", self.tensor_parallel_size, allow_auto=True)
        _check_positive_int(owner, "pipeline_parallel_size", self.pipeline_parallel_size)
        if not isinstance(self.allow_cross_node_tensor_parallel, bool):
            raise TypeError(
                f"{_call(owner, allow_cross_node_tensor_parallel=self.allow_cross_node_tensor_parallel)}: expected a bool"
            )
        for name in ("num_heads", "num_layers"):
            if getattr(self, name) is not None:
                _check_positive_int(owner, name, getattr(self, name))

        world = self.world_size
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        world_text = f"the world size {world} ({nodes} x {self.devices_per_node} devices per node)"
        tp = self.devices_per_node if self.tensor_parallel_size == "auto" else self.tensor_parallel_size
        pp = self.pipeline_parallel_size
        if world % tp:
            raise ValueError(f"{_call(owner, tensor_parallel_size=tp)}: {tp} does not divide {world_text}")
        if world % pp:
            raise ValueError(f"{_call(owner, pipeline_parallel_size=pp)}: {pp} does not divide {world_text}")
        if world % (tp * pp):
            raise ValueError(
                f"{_call(owner, tensor_parallel_size=tp, pipeline_parallel_size=pp)}: "
                f"{tp} x {pp} = {tp * pp} does not divide {world_text}"
            )
        if self.data_parallel_size in ("auto", None):
            dp = world // (tp * pp)
        else:
            dp = self.data_parallel_size
            if dp * tp * pp != world:
                raise ValueError(
                    f"{_call(owner, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp)}: "
                    f"{dp} x {tp} x {pp} = {dp * tp * pp} does not equal {world_text}; "
                    f'data_parallel_size="auto" would be {world // (tp * pp)}'
                )
        if self.devices_per_node % tp and not self.allow_cross_node_tensor_parallel:
            raise ValueError(self._cross_node_message(tp, pp))
        if self.num_heads is not None and self.num_heads % tp:
            fits = [d for d in _divisors(self.num_heads) if self.devices_per_node % d == 0]
            raise ValueError(
                f"{_call(owner, tensor_parallel_size=tp)}: the model's {self.num_heads} attention heads do not split "
                f"evenly over {tp} devices; choose one that divides both {self.num_heads} and the "
                f"{self.devices_per_node} devices per node: {', '.join(map(str, fits))}"
            )
        if self.num_layers is not None and self.num_layers % pp:
            raise ValueError(
                f"{_call(owner, pipeline_parallel_size=pp)}: the model's {self.num_layers} layers do not split evenly "
                f"into {pp} stages; choose a divisor of {self.num_layers}"
            )
        object.__setattr__(self, "data_parallel_size", dp)
        object.__setattr__(self, "tensor_parallel_size", tp)

    def _cross_node_message(self, tp: int, pp: int) -> str:
        dpn = self.devices_per_node
        ratio = self.intra_node_bandwidth_bytes_per_s / self.inter_node_bandwidth_bytes_per_s
        inside = math.gcd(tp, dpn)
        rest = tp // inside
        span = "span" if tp > dpn else "straddle"
        return (
            f"{_call(self.owner, tensor_parallel_size=tp)}: tensor-parallel groups of {tp} consecutive ranks would "
            f"{span} nodes of {dpn} devices. Tensor parallelism all-reduces activations several times per layer, and "
            f"the inter-node link ({self.inter_node_bandwidth_bytes_per_s / 1e9:g} GB/s per device) is about "
            f"{ratio:.0f}x slower than the intra-node link ({self.intra_node_bandwidth_bytes_per_s / 1e9:g} GB/s). "
            f"Choose a tensor_parallel_size that divides {dpn} ({', '.join(map(str, _divisors(dpn)))}) and move the "
            f"rest to data or pipeline parallelism, e.g. tensor_parallel_size={inside} with "
            f"pipeline_parallel_size={pp * rest} or a data_parallel_size {rest}x larger; "
            f"or pass allow_cross_node_tensor_parallel=True to keep this placement."
        )

    @classmethod
    def for_cluster(cls, cluster: ClusterShape, **options: Any) -> ParallelConfig:
        """A config on ``cluster``'s nodes and links; ``options`` are the other fields (sizes, model, owner)."""
        return cls(
            num_nodes=cluster.num_nodes,
            devices_per_node=cluster.devices_per_node,
            intra_node_bandwidth_bytes_per_s=cluster.intra_node_bandwidth_bytes_per_s,
            inter_node_bandwidth_bytes_per_s=cluster.inter_node_bandwidth_bytes_per_s,
            **options,
        )

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node

    @property
    def cluster(self) -> ClusterShape:
        """The cluster this config is laid out on."""
        return ClusterShape(
            num_nodes=self.num_nodes,
            devices_per_node=self.devices_per_node,
            intra_node_bandwidth_bytes_per_s=self.intra_node_bandwidth_bytes_per_s,
            inter_node_bandwidth_bytes_per_s=self.inter_node_bandwidth_bytes_per_s,
        )

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """``(pipeline_parallel_size, data_parallel_size, tensor_parallel_size)``, outermost first."""
        return (self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size)  # type: ignore[return-value]

    @property
    def mesh_dim_names(self) -> tuple[str, str, str]:
        """``("pipeline_parallel", "data_parallel", "tensor_parallel")``."""
        return layout.MESH_DIM_NAMES

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline stage, data-parallel index, tensor-parallel index)`` of global ``rank``."""
        return layout.coordinates(rank, self.mesh_shape)

    def rank_at(self, pipeline: int, data: int, tensor: int) -> int:
        """The global rank at a coordinate; the inverse of :meth:`coordinates`."""
        return layout.rank_at((pipeline, data, tensor), self.mesh_shape)

    def ranks_of_group(self, axis: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis`` (``"pipeline_parallel"``, ``"data_parallel"`` or
        ``"tensor_parallel"``), in the order of that axis."""
        return layout.group_ranks(axis, rank, self.mesh_shape)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``; together they partition the ranks."""
        return layout.all_groups(axis, self.mesh_shape)

    def node_of(self, rank: int) -> int:
        """The node that hosts global ``rank`` (torchrun numbers a node's ranks consecutively)."""
        layout.coordinates(rank, self.mesh_shape)  # validates rank
        return rank // self.devices_per_node
