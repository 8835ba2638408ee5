"""The shape of a cluster: how many nodes, how many devices on each, and how fast the two links between them are.

:class:`ClusterShape` is what :class:`~lightning_ft.parallel.ParallelConfig` lays ranks out on, and the base of the
planner's :class:`~lightning_ft.parallel.ClusterSpec`, which adds what one device can hold and compute. The link speeds
decide where each parallel axis may go: tensor parallelism all-reduces activations several times per layer, so it
belongs on the fast intra-node link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_ft.parallel.validation import check_positive_int, render_call

__all__ = ["INFINIBAND_BANDWIDTH_BYTES_PER_S", "NVLINK_BANDWIDTH_BYTES_PER_S", "ClusterShape", "check_bandwidth"]

NVLINK_BANDWIDTH_BYTES_PER_S = 450e9
"""Intra-node link, per device and direction: NVLink 4 on an H100 SXM (18 links x 25 GB/s)."""
INFINIBAND_BANDWIDTH_BYTES_PER_S = 50e9
"""Inter-node link, per device and direction: one 400 Gb/s InfiniBand NDR adapter per GPU."""


def check_bandwidth(owner: str | None, name: str, value: Any) -> None:
    """Refuse a bandwidth that is not a positive number of bytes per second.

    Raises:
        ValueError: naming the option and the value, ``ClusterShape(inter_node_bandwidth_bytes_per_s=0): ...``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{render_call(owner, **{name: value})}: must be a positive number of bytes per second")


@dataclass(kw_only=True, frozen=True)
class ClusterShape:
    """The nodes of a cluster and the speed of the two links that decide where each parallel axis may go.

    Example::

        shape = ClusterShape(num_nodes=4, devices_per_node=8)
        shape.world_size  # 32

    Raises:
        TypeError: ``num_nodes`` or ``devices_per_node`` is not an int.
        ValueError: a count below 1 or a bandwidth that is not a positive number.
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
        check_positive_int(owner, "num_nodes", self.num_nodes)
        check_positive_int(owner, "devices_per_node", self.devices_per_node)
        check_bandwidth(owner, "intra_node_bandwidth_bytes_per_s", self.intra_node_bandwidth_bytes_per_s)
        check_bandwidth(owner, "inter_node_bandwidth_bytes_per_s", self.inter_node_bandwidth_bytes_per_s)

    @property
    def world_size(self) -> int:
        """Total number of devices: ``num_nodes * devices_per_node``."""
        return self.num_nodes * self.devices_per_node
