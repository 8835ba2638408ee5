"""The validated 3D-parallel configuration: data x tensor x pipeline sizes on a cluster of nodes.

:class:`ParallelConfig` is what ``ElasticFT3D`` and the planner agree on. It checks a request before any process group
exists (sizes multiply to the world size, tensor-parallel groups stay inside a node, the model's heads and layers
divide evenly) and raises errors that name the option as the user typed it, then maps every global rank to its
``(pipeline, data, tensor)`` coordinate in Megatron-LM's order (see :mod:`lightning_ft.parallel.layout`). It holds the
:class:`~lightning_ft.parallel.ClusterShape` it is laid out on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_ft.parallel import layout
from lightning_ft.parallel.cluster_shape import (
    INFINIBAND_BANDWIDTH_BYTES_PER_S,
    NVLINK_BANDWIDTH_BYTES_PER_S,
    ClusterShape,
    check_bandwidth,
)
from lightning_ft.parallel.validation import check_positive_int, divisors, render_call

__all__ = ["INFINIBAND_BANDWIDTH_BYTES_PER_S", "NVLINK_BANDWIDTH_BYTES_PER_S", "ClusterShape", "ParallelConfig"]

_SHAPE_OPTIONS = (
    "num_nodes",
    "devices_per_node",
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
)


@dataclass(kw_only=True, frozen=True, init=False)
class ParallelConfig:
    """Data, tensor and pipeline sizes on a cluster, validated, with the rank layout.

    The cluster is given either whole, ``cluster=ClusterShape(...)``, or by its parts: ``devices_per_node=`` and
    optionally ``num_nodes=`` (default 1), ``intra_node_bandwidth_bytes_per_s=`` and
    ``inter_node_bandwidth_bytes_per_s=`` (defaults: NVLink 4 and 400 Gb/s InfiniBand); the parts stay readable as
    attributes (``config.num_nodes`` is ``config.cluster.num_nodes``).

    After construction every size is an int: ``"auto"`` is resolved. Ranks are laid out in Megatron-LM's order:
    tensor-parallel groups are consecutive ranks inside one node, pipeline stages are the outermost axis, data parallel
    sits in between. Ranks of one tensor-parallel or pipeline group see the same batch; the data-parallel coordinate
    (``coordinates(rank)[1]``) picks the batch.

    Example::

        config = ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2, num_nodes=2, devices_per_node=8)
        config.data_parallel_size            # 2
        config.coordinates(13)               # (1, 1, 1): stage 1, data-parallel replica 1, tensor shard 1
        config.ranks_of_group("tensor_parallel", 13)  # [12, 13, 14, 15]
        shape = ClusterShape(num_nodes=2, devices_per_node=8)
        ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2, cluster=shape) == config  # True

    Raises:
        TypeError: if a size is not an int (or ``"auto"`` where allowed), ``cluster`` is not a ``ClusterShape``, or the
            cluster is given both whole and by its parts, or neither.
        ValueError: if the sizes do not multiply to the world size, a tensor-parallel group would cross a node (unless
            ``allow_cross_node_tensor_parallel=True``), or the model's heads or layers do not divide evenly.
    """

    data_parallel_size: int
    """Data-parallel replicas. Given as ``"auto"`` (the default) or None: world size / (tensor x pipeline)."""
    tensor_parallel_size: int
    """Devices that shard each layer; default 1. Given as ``"auto"``: the devices per node, as in Lightning's
    ModelParallelStrategy."""
    pipeline_parallel_size: int
    """Pipeline stages; default 1, no pipelining."""
    cluster: ClusterShape
    """The nodes, devices per node and links the ranks are laid out on."""
    allow_cross_node_tensor_parallel: bool
    """Accept tensor-parallel groups that span nodes, and their slow inter-node all-reduces; default False."""
    num_heads: int | None
    """Attention heads of the model, if known: must divide by ``tensor_parallel_size``. None (default): not checked."""
    num_layers: int | None
    """Transformer layers of the model, if known: must divide by ``pipeline_parallel_size``. None (default): not
    checked."""
    owner: str | None = field(compare=False, repr=False)
    """Name that prefixes error messages, e.g. ``"ElasticFT3D"``; default ``"ParallelConfig"``; None: options only."""

    def __init__(
        self,
        *,
        data_parallel_size: int | Literal["auto"] | None = "auto",
        tensor_parallel_size: int | Literal["auto"] = 1,
        pipeline_parallel_size: int = 1,
        cluster: ClusterShape | None = None,
        num_nodes: int | None = None,
        devices_per_node: int | None = None,
        intra_node_bandwidth_bytes_per_s: float | None = None,
        inter_node_bandwidth_bytes_per_s: float | None = None,
        allow_cross_node_tensor_parallel: bool = False,
        num_heads: int | None = None,
        num_layers: int | None = None,
        owner: str | None = "ParallelConfig",
    ) -> None:
        # Hand-written so that the cluster can also be given by its parts while the fields hold it once; the
        # generated __eq__, __hash__, __repr__ and dataclasses.replace() see only the fields.
        parts = dict(
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            intra_node_bandwidth_bytes_per_s=intra_node_bandwidth_bytes_per_s,
            inter_node_bandwidth_bytes_per_s=inter_node_bandwidth_bytes_per_s,
        )
        values = dict(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            cluster=_cluster(owner, cluster, {name: value for name, value in parts.items() if value is not None}),
            allow_cross_node_tensor_parallel=allow_cross_node_tensor_parallel,
            num_heads=num_heads,
            num_layers=num_layers,
            owner=owner,
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        owner = self.owner
        if self.data_parallel_size is not None:
            check_positive_int(owner, "data_parallel_size", self.data_parallel_size, allow_auto=True)
        check_positive_int(owner, "tensor_parallel_size", self.tensor_parallel_size, allow_auto=True)
        check_positive_int(owner, "pipeline_parallel_size", self.pipeline_parallel_size)
        if not isinstance(self.allow_cross_node_tensor_parallel, bool):
            raise TypeError(
                f"{render_call(owner, allow_cross_node_tensor_parallel=self.allow_cross_node_tensor_parallel)}: "
                "expected a bool"
            )
        for name in ("num_heads", "num_layers"):
            if getattr(self, name) is not None:
                check_positive_int(owner, name, getattr(self, name))

        world = self.world_size
        nodes = f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''}"
        world_text = f"the world size {world} ({nodes} x {self.devices_per_node} devices per node)"
        tp = self.devices_per_node if self.tensor_parallel_size == "auto" else self.tensor_parallel_size
        pp = self.pipeline_parallel_size
        if world % tp:
            raise ValueError(f"{render_call(owner, tensor_parallel_size=tp)}: {tp} does not divide {world_text}")
        if world % pp:
            raise ValueError(f"{render_call(owner, pipeline_parallel_size=pp)}: {pp} does not divide {world_text}")
        if world % (tp * pp):
            raise ValueError(
                f"{render_call(owner, tensor_parallel_size=tp, pipeline_parallel_size=pp)}: "
                f"{tp} x {pp} = {tp * pp} does not divide {world_text}"
            )
        if self.data_parallel_size in ("auto", None):
            dp = world // (tp * pp)
        else:
            dp = self.data_parallel_size
            if dp * tp * pp != world:
                raise ValueError(
                    f"{render_call(owner, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp)}: "
                    f"{dp} x {tp} x {pp} = {dp * tp * pp} does not equal {world_text}; "
                    f'data_parallel_size="auto" would be {world // (tp * pp)}'
                )
        if self.devices_per_node % tp and not self.allow_cross_node_tensor_parallel:
            raise ValueError(self._cross_node_message(tp, pp))
        if self.num_heads is not None and self.num_heads % tp:
            fits = [d for d in divisors(self.num_heads) if self.devices_per_node % d == 0]
            raise ValueError(
                f"{render_call(owner, tensor_parallel_size=tp)}: the model's {self.num_heads} attention heads do not "
                f"split evenly over {tp} devices; choose one that divides both {self.num_heads} and the "
                f"{self.devices_per_node} devices per node: {', '.join(map(str, fits))}"
            )
        if self.num_layers is not None and self.num_layers % pp:
            raise ValueError(
                f"{render_call(owner, pipeline_parallel_size=pp)}: the model's {self.num_layers} layers do not split "
                f"evenly into {pp} stages; choose a divisor of {self.num_layers}"
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
            f"{render_call(self.owner, tensor_parallel_size=tp)}: tensor-parallel groups of {tp} consecutive ranks would "
            f"{span} nodes of {dpn} devices. Tensor parallelism all-reduces activations several times per layer, and "
            f"the inter-node link ({self.inter_node_bandwidth_bytes_per_s / 1e9:g} GB/s per device) is about "
            f"{ratio:.0f}x slower than the intra-node link ({self.intra_node_bandwidth_bytes_per_s / 1e9:g} GB/s). "
            f"Choose a tensor_parallel_size that divides {dpn} ({', '.join(map(str, divisors(dpn)))}) and move the "
            f"rest to data or pipeline parallelism, e.g. tensor_parallel_size={inside} with "
            f"pipeline_parallel_size={pp * rest} or a data_parallel_size {rest}x larger; "
            f"or pass allow_cross_node_tensor_parallel=True to keep this placement."
        )

    @classmethod
    def for_cluster(cls, cluster: ClusterShape, **options: Any) -> ParallelConfig:
        """A config on ``cluster``'s nodes and links; ``options`` are the other arguments (sizes, model, owner).
        The same as ``ParallelConfig(cluster=cluster, **options)``."""
        return cls(cluster=cluster, **options)

    @property
    def num_nodes(self) -> int:
        """Number of nodes: ``cluster.num_nodes``."""
        return self.cluster.num_nodes

    @property
    def devices_per_node(self) -> int:
        """Devices (processes) per node: ``cluster.devices_per_node``."""
        return self.cluster.devices_per_node

    @property
    def intra_node_bandwidth_bytes_per_s(self) -> float:
        """Intra-node link per device, bytes per second: ``cluster.intra_node_bandwidth_bytes_per_s``."""
        return self.cluster.intra_node_bandwidth_bytes_per_s

    @property
    def inter_node_bandwidth_bytes_per_s(self) -> float:
        """Inter-node link per device, bytes per second: ``cluster.inter_node_bandwidth_bytes_per_s``."""
        return self.cluster.inter_node_bandwidth_bytes_per_s

    @property
    def world_size(self) -> int:
        """Total number of ranks: ``num_nodes * devices_per_node``."""
        return self.cluster.world_size

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


def _cluster(owner: str | None, cluster: ClusterShape | None, parts: dict[str, Any]) -> ClusterShape:
    """The cluster given whole or built from its parts, refusing both, neither, or a part that is not valid."""
    if cluster is not None:
        if not isinstance(cluster, ClusterShape):
            raise TypeError(f"{render_call(owner, cluster=cluster)}: expected a ClusterShape")
        if parts:
            raise TypeError(
                f"{render_call(owner, cluster=cluster, **parts)}: give the cluster either as cluster=ClusterShape(...) "
                f"or by its parts ({', '.join(_SHAPE_OPTIONS)}), not both"
            )
        return cluster
    if "devices_per_node" not in parts:
        raise TypeError(
            f"{render_call(owner, **parts)}: missing devices_per_node (with num_nodes), or cluster=ClusterShape(...)"
        )
    # Checked here, not by ClusterShape, so that the message names the owner the user called.
    check_positive_int(owner, "num_nodes", parts.get("num_nodes", 1))
    check_positive_int(owner, "devices_per_node", parts["devices_per_node"])
    for name in ("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s"):
        if name in parts:
            check_bandwidth(owner, name, parts[name])
    return ClusterShape(**parts)
