"""Rank layout of the 3D mesh: which global rank sits at which (pipeline, data, tensor) coordinate.

lightning-ft follows Megatron-LM's order: the tensor-parallel index varies fastest, so a tensor-parallel group is a run
of consecutive ranks and stays inside one node whenever its size divides the devices per node (torchrun numbers the
ranks of one node consecutively); data parallel sits in between; the pipeline stage varies slowest, so stages are the
outermost axis and span nodes. The functions here are pure arithmetic on the mesh shape ``(pp, dp, tp)`` and match the
row-major layout that ``torch.distributed.device_mesh.init_device_mesh`` builds, so the coordinates a rank computes
before any process group exists are the ones its :class:`~torch.distributed.device_mesh.DeviceMesh` reports later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_ft.parallel.parallel_config import ParallelConfig

PIPELINE_PARALLEL = "pipeline_parallel"
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
MESH_DIM_NAMES: tuple[str, str, str] = (PIPELINE_PARALLEL, DATA_PARALLEL, TENSOR_PARALLEL)
"""Names of the mesh dimensions, outermost first; the last two are the names Lightning's ModelParallelStrategy uses."""


def _axis_index(axis: str) -> int:
    if axis not in MESH_DIM_NAMES:
        raise ValueError(f"axis={axis!r}: expected one of {', '.join(repr(name) for name in MESH_DIM_NAMES)}")
    return MESH_DIM_NAMES.index(axis)


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank={rank!r}: expected an int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world size {world_size}")


def coordinates(rank: int, mesh_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The ``(pipeline, data, tensor)`` coordinate of ``rank`` in a mesh of shape ``(pp, dp, tp)``."""
    pp, dp, tp = mesh_shape
    _check_rank(rank, pp * dp * tp)
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def rank_at(coordinate: tuple[int, int, int], mesh_shape: tuple[int, int, int]) -> int:
    """The global rank at ``(pipeline, data, tensor)`` coordinate ``coordinate``; the inverse of :func:`coordinates`."""
    if len(coordinate) != 3:
        raise ValueError(f"coordinate {tuple(coordinate)}: expected (pipeline, data, tensor) indices")
    for index, size, name in zip(coordinate, mesh_shape, MESH_DIM_NAMES, strict=True):
        if not 0 <= index < size:
            raise ValueError(f"coordinate {tuple(coordinate)}: the {name} index {index} is outside 0..{size - 1}")
    p, d, t = coordinate
    _, dp, tp = mesh_shape
    return (p * dp + d) * tp + t


def group_ranks(axis: str, rank: int, mesh_shape: tuple[int, int, int]) -> list[int]:
    """The ranks in ``rank``'s group along ``axis``: those that share its other two coordinates, in axis order."""
    dim = _axis_index(axis)
    coordinate = list(coordinates(rank, mesh_shape))
    ranks = []
    for index in range(mesh_shape[dim]):
        coordinate[dim] = index
        ranks.append(rank_at((coordinate[0], coordinate[1], coordinate[2]), mesh_shape))
    return ranks


def all_groups(axis: str, mesh_shape: tuple[int, int, int]) -> list[list[int]]:
    """Every group along ``axis``, each in axis order, ordered by their smallest rank; together they partition the ranks."""
    _axis_index(axis)
    world_size = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]
    seen: set[int] = set()
    groups = []
    for rank in range(world_size):
        if rank not in seen:
            group = group_ranks(axis, rank, mesh_shape)
            seen.update(group)
            groups.append(group)
    return groups


def build_device_mesh(config: ParallelConfig, device_type: str) -> DeviceMesh:
    """Build the 3D ``DeviceMesh`` for ``config`` with dimensions ``("pipeline_parallel", "data_parallel",
    "tensor_parallel")``.

    The mesh is always three-dimensional, with sizes of 1 where an axis is unused, so ``mesh["data_parallel"]`` and
    ``mesh["tensor_parallel"]`` work for modules written for Lightning's ``ModelParallelStrategy``.

    Calling contract: collective. Every rank of the default process group must call it, after
    ``torch.distributed.init_process_group`` and with an equal ``config``; it creates the process groups of each axis.

    Raises:
        RuntimeError: if no default process group exists.
        ValueError: if the process group's world size is not ``config.world_size``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_device_mesh: call torch.distributed.init_process_group() first")
    world_size = dist.get_world_size()
    if world_size != config.world_size:
        raise ValueError(
            f"build_device_mesh: the process group has {world_size} ranks but the config describes "
            f"{config.world_size} ({config.num_nodes} nodes x {config.devices_per_node} devices per node)"
        )
    # init_device_mesh lays ranks out row-major over the shape, which is exactly `coordinates` above.
    return init_device_mesh(device_type, config.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
