"""One ownership rule: every region held by several ranks is written once, by one of its holders, bytes balanced."""

from __future__ import annotations

import random

import torch

from lightning_ft.checkpoint.ownership import Region, assign_owners, held_region, regions_to_write


def region(key: str, offset: tuple[int, ...], shape: tuple[int, ...], itemsize: int = 4) -> Region:
    return Region(key, offset, shape, itemsize * int(torch.Size(shape).numel()))


def check_written_once_by_a_holder(holdings: list[list[Region]], owners: dict[Region, int]) -> list[int]:
    """Every distinct region has one owner that holds it; returns the bytes each rank writes."""
    distinct = {r for regions in holdings for r in regions}
    assert set(owners) == distinct
    for r, owner in owners.items():
        assert r in holdings[owner], f"{r} assigned to rank {owner}, which does not hold it"
    load = [0] * len(holdings)
    for r, owner in owners.items():
        load[owner] += r.nbytes
    return load


def test_plain_replicas_go_largest_first_to_the_least_loaded_rank():
    a, b, c, d = region("a", (0,), (25,)), region("b", (0,), (15,)), region("c", (0,), (12,)), region("d", (0,), (3,))
    plain = [d, b, a, c]  # the order a rank lists its tensors in does not matter
    owners = assign_owners([plain, list(reversed(plain))])
    assert owners == {a: 0, b: 1, c: 1, d: 0}
    assert check_written_once_by_a_holder([plain, plain], owners) == [112, 108]


def test_replicas_along_a_replicate_mesh_dimension_are_written_once_and_spread_over_their_holders():
    # A (2, 2) mesh with placements [Shard(0), Replicate()] on an 8x4 tensor: ranks 0 and 1 hold rows 0-3, ranks 2
    # and 3 hold rows 4-7. A second such tensor and a plain replica held by all four.
    top, bottom = region("w", (0, 0), (4, 4)), region("w", (4, 0), (4, 4))
    top2, bottom2 = region("v", (0, 0), (4, 4)), region("v", (4, 0), (4, 4))
    bias = region("bias", (0,), (4,))
    holdings = [[top, top2, bias], [top, top2, bias], [bottom, bottom2, bias], [bottom, bottom2, bias]]
    owners = assign_owners(holdings)
    load = check_written_once_by_a_holder(holdings, owners)
    assert {owners[top], owners[top2]} == {0, 1} and {owners[bottom], owners[bottom2]} == {2, 3}
    assert sorted(load) == [64, 64, 64, 80]


def test_twins_on_disjoint_sub_meshes_are_written_once():
    # FSDP over a size-1 data-parallel slice on each of two tensor-parallel ranks: each rank's mesh holds only itself,
    # so the placements say "not replicated", yet both ranks hold the same full embedding.
    embedding = region("embedding", (0, 0), (6, 4))
    col0, col1 = region("w1", (0, 0), (4, 2)), region("w1", (0, 2), (4, 2))  # a tensor-parallel shard on each
    holdings = [[embedding, col0], [embedding, col1]]
    owners = assign_owners(holdings)
    assert check_written_once_by_a_holder(holdings, owners) == [128, 32]
    assert owners[col0] == 0 and owners[col1] == 1


def test_a_region_held_by_one_rank_is_written_by_it_however_loaded_it_is():
    big, only_on_1 = region("big", (0,), (100,)), region("x", (0,), (1,))
    owners = assign_owners([[big], [big, only_on_1]])
    assert owners == {big: 0, only_on_1: 1}
    owners = assign_owners([[big], [only_on_1]])
    assert owners == {big: 0, only_on_1: 1}


def test_the_assignment_is_deterministic_and_balanced_within_the_largest_region():
    rng = random.Random(0)
    regions = [region(f"t{i}", (0,), (rng.randint(1, 50),)) for i in range(40)]
    shuffled = regions[:]
    rng.shuffle(shuffled)
    owners = assign_owners([regions, shuffled, regions])
    assert owners == assign_owners([shuffled, regions, shuffled])
    load = check_written_once_by_a_holder([regions] * 3, owners)
    assert max(load) - min(load) <= max(r.nbytes for r in regions)


def test_plain_tensors_are_split_between_ranks_without_any_communication():
    # No process group exists here: each rank decides alone, and together they write every tensor exactly once.
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(60)), ("c", torch.zeros(50, dtype=torch.float64))]
    mine = {rank: regions_to_write(tensors, rank=rank, world_size=2, group=None) for rank in (0, 1)}
    keys = {rank: sorted(r.key for r, _ in writes) for rank, writes in mine.items()}
    assert keys == {0: ["a", "b"], 1: ["c"]}
    for writes in mine.values():
        for r, value in writes:
            assert value is dict(tensors)[r.key]  # the caller's tensor: staging copies it, ownership does not


def test_the_region_of_a_plain_tensor_is_the_whole_tensor():
    r, value = held_region("m/w", torch.zeros(3, 5, dtype=torch.bfloat16))
    assert r == Region("m/w", (0, 0), (3, 5), 30) and value.shape == (3, 5)
