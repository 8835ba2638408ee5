"""DTensor placements are recorded in the index as JSON; a placement a state dict never holds is refused."""

from __future__ import annotations

import pytest

from lightning_ft._compat import Replicate, Shard, StridedShard
from lightning_ft.checkpoint.dtensor_geometry import describe_placements

try:
    from torch.distributed.tensor import Partial
except ImportError:  # torch 2.4
    from torch.distributed._tensor import Partial


def test_shard_replicate_and_strided_shard_placements_are_described():
    placements = [Shard(1), Replicate()]
    expected = [{"type": "shard", "dim": 1}, {"type": "replicate"}]
    if StridedShard is not None:
        placements.append(StridedShard(0, split_factor=2))
        expected.append({"type": "strided_shard", "dim": 0, "split_factor": 2})
    assert describe_placements(placements) == expected


def test_a_partial_placement_is_refused_naming_it():
    with pytest.raises(TypeError, match="Partial.*reduce partial values before saving"):
        describe_placements([Shard(0), Partial()])
