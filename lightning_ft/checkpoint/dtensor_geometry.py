"""Where a DTensor's local shard sits in the global tensor, and how its placements are recorded in the index.

The DTensor classes themselves come from :mod:`lightning_ft._compat` (their import path moved between torch 2.4 and
2.5). ``_StridedShard`` (FSDP2 over tensor parallel) is handled by torch's own ``compute_local_shape_and_global_offset``,
which knows its layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_ft._compat import Replicate, Shard, StridedShard, compute_local_shape_and_global_offset

__all__ = ["describe_placements", "local_region"]


def local_region(global_shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> tuple[list[int], list[int]]:
    """``(local_shape, global_offset)`` of this rank's shard of a tensor with ``global_shape`` laid out on ``mesh``."""
    shape, offset = compute_local_shape_and_global_offset(list(global_shape), mesh, list(placements))
    return list(shape), list(offset)


def describe_placements(placements: Sequence[Any]) -> list[dict[str, Any]]:
    """JSON description of DTensor placements, e.g. ``[{"type": "shard", "dim": 0}, {"type": "replicate"}]``.

    Raises:
        TypeError: a placement other than ``Shard``, ``_StridedShard`` or ``Replicate`` (``Partial`` holds unreduced
            values, which a state dict never holds).
    """
    out: list[dict[str, Any]] = []
    for placement in placements:
        if StridedShard is not None and isinstance(placement, StridedShard):
            out.append({"type": "strided_shard", "dim": placement.dim, "split_factor": placement.split_factor})
        elif isinstance(placement, Shard):
            out.append({"type": "shard", "dim": placement.dim})
        elif isinstance(placement, Replicate):
            out.append({"type": "replicate"})
        else:
            raise TypeError(
                f"DTensor placement {placement!r} cannot be checkpointed: reduce partial values before saving "
                "(state dicts hold Shard/Replicate placements)"
            )
    return out
