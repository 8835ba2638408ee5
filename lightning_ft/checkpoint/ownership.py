"""Who writes which bytes of the state: one rule for every kind of replica, decided before anything is copied.

Each rank holds *regions* of the logical tensors in the state: a plain tensor whole, a DTensor its local shard (global
offset and shape from its mesh and placements). Several ranks can hold the same region:

- a plain tensor is a data-parallel replica: every rank holds the same plain tensors (the save contract says every rank
  passes the same state structure);
- a DTensor shard is repeated along the ``Replicate`` dimensions of its mesh;
- a DTensor whose mesh is a slice of the world (an FSDP mesh over the data-parallel axis while tensor-parallel peers
  hold the same values, say) has identical twins on ranks outside its mesh, which its placements cannot see.

:func:`assign_owners` is the one rule for all three: each distinct region is written by exactly one of the ranks
holding it; regions go largest first, each to the holder with the fewest bytes assigned so far (ties to the lower rank),
so the rule is deterministic and spreads the bytes over the ranks.

:func:`regions_to_write` applies it. Who holds a plain tensor is known without communication. Who holds a DTensor
region is not (twins outside a mesh), so when the state holds a DTensor every rank sends the ``(key, offset, shape,
bytes)`` of its DTensor regions to every other rank in one small exchange. :meth:`AsyncCheckpointer.save` runs it
before copying, so each rank stages only what it writes. The exchange is not cached between saves: skipping it is safe
only if every rank makes the same decision to skip, and a rank cannot see whether a twin on another sub-mesh changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ft._compat import DTensor
from lightning_ft.checkpoint.agreement import agree
from lightning_ft.checkpoint.dtensor_geometry import local_region
from lightning_ft.checkpoint.errors import CheckpointWriteError

__all__ = ["Region", "assign_owners", "held_region", "regions_to_write"]


@dataclass(frozen=True)
class Region:
    """A box of one logical tensor, as stored: identical regions on different ranks are the same bytes."""

    key: str
    """The logical tensor's key in the checkpoint index."""
    offset: tuple[int, ...]
    """Global offset of the box (all zeros for a plain tensor)."""
    shape: tuple[int, ...]
    """Shape of the box."""
    nbytes: int
    """Bytes the box takes."""


def held_region(key: str, tensor: torch.Tensor) -> tuple[Region, torch.Tensor] | None:
    """The region of tensor ``key`` this rank holds and the local tensor holding its values.

    ``None`` for a DTensor whose mesh does not include this rank.
    """
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return None
        local = tensor.to_local()
        _, offset = local_region(tensor.shape, tensor.device_mesh, tensor.placements)
        return Region(key, tuple(offset), tuple(local.shape), local.numel() * local.element_size()), local
    nbytes = tensor.numel() * tensor.element_size()
    return Region(key, (0,) * tensor.dim(), tuple(tensor.shape), nbytes), tensor


def assign_owners(holdings: Sequence[Iterable[Region]]) -> dict[Region, int]:
    """The rank that writes each region, given ``holdings[r]``: the regions rank ``r`` holds.

    Pure and deterministic: every rank computes the same answer from the same holdings. Regions are taken largest
    first (then by key, offset and shape); each goes to the rank with the fewest bytes assigned so far among those
    holding it, the lower rank on a tie.

    Example::

        w = Region("w", (0,), (4,), 16)
        assign_owners([[w], [w]])  # {w: 0}: written once, by one of its two holders
    """
    holders: dict[Region, list[int]] = {}
    for rank, regions in enumerate(holdings):
        for region in regions:
            holders.setdefault(region, []).append(rank)
    load = [0] * len(holdings)
    owners: dict[Region, int] = {}
    for region in sorted(holders, key=lambda r: (-r.nbytes, r.key, r.offset, r.shape)):
        owner = min(holders[region], key=lambda r: (load[r], r))
        owners[region] = owner
        load[owner] += region.nbytes
    return owners


def regions_to_write(
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> list[tuple[Region, torch.Tensor]]:
    """The regions of ``tensors`` (``(key, tensor)`` pairs of the shared state) that this rank writes, with their values.

    Collective over ``group`` when ``tensors`` holds a DTensor (every rank calls, with the same keys): one exchange of
    the DTensor regions each rank holds; no communication otherwise. Do not call it while another collective on
    ``group`` may be running.

    Raises:
        CheckpointWriteError: finding the regions failed on another rank (the failing rank raises its own error).
    """
    held: list[tuple[Region, torch.Tensor]] = []
    plain: list[Region] = []
    sharded: list[Region] = []
    error: BaseException | None = None
    try:
        for key, tensor in tensors:
            found = held_region(key, tensor)
            if found is not None:
                held.append(found)
                (sharded if isinstance(tensor, DTensor) else plain).append(found[0])
    except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below
        error = e
    if any(isinstance(tensor, DTensor) for _, tensor in tensors):
        others = agree(error, sharded, group=group, what="checkpoint save", error_type=CheckpointWriteError)
    elif error is not None:
        raise error
    else:
        others = [[] for _ in range(world_size)]
    owners = assign_owners([plain + theirs for theirs in others])
    return [(region, value) for region, value in held if owners[region] == rank]
