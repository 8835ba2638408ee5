"""Rank layout: every factorisation of small world sizes, and agreement with the DeviceMesh torch builds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_ft.parallel.layout import MESH_DIM_NAMES, build_device_mesh
from lightning_ft.parallel.parallel_config import ParallelConfig
from tests.helpers import run_distributed

AXES = ("pipeline_parallel", "data_parallel", "tensor_parallel")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _all_configs(max_world: int = 16, allow_cross_node: bool = False) -> list[ParallelConfig]:
    """Every (nodes, devices per node, tp, pp) with world <= max_world that the config accepts."""
    configs = []
    for world in range(1, max_world + 1):
        for devices_per_node in _divisors(world):
            for tp in _divisors(world):
                if not allow_cross_node and devices_per_node % tp:
                    continue
                for pp in _divisors(world // tp):
                    configs.append(
                        ParallelConfig(
                            tensor_parallel_size=tp,
                            pipeline_parallel_size=pp,
                            num_nodes=world // devices_per_node,
                            devices_per_node=devices_per_node,
                            allow_cross_node_tensor_parallel=allow_cross_node,
                        )
                    )
    return configs


CONFIGS = _all_configs()


def test_the_sweep_covers_every_factorisation_of_world_sizes_up_to_16():
    # Sum over world sizes of (#devices_per_node choices) x (#(tp, pp) with tp | dpn): at least the single-node ones.
    single_node = [c for c in CONFIGS if c.num_nodes == 1]
    expected = sum(sum(len(_divisors(w // tp)) for tp in _divisors(w)) for w in range(1, 17))
    assert len(single_node) == expected
    assert {c.world_size for c in CONFIGS} == set(range(1, 17))


@pytest.mark.parametrize("axis", AXES)
def test_groups_of_every_axis_partition_the_ranks(axis):
    for config in CONFIGS:
        groups = config.groups(axis)
        flat = sorted(rank for group in groups for rank in group)
        assert flat == list(range(config.world_size)), config
        size = config.mesh_shape[AXES.index(axis)]
        assert all(len(group) == size for group in groups), config
        for group in groups:
            for rank in group:
                assert config.ranks_of_group(axis, rank) == group


def test_tensor_parallel_groups_are_consecutive_ranks_inside_one_node():
    for config in CONFIGS:
        for group in config.groups("tensor_parallel"):
            assert group == list(range(group[0], group[0] + len(group))), config
            assert len({config.node_of(rank) for rank in group}) == 1, config


def test_tensor_parallel_groups_cross_nodes_only_when_allowed():
    crossing = [
        c
        for c in _all_configs(allow_cross_node=True)
        if any(len({c.node_of(r) for r in group}) > 1 for group in c.groups("tensor_parallel"))
    ]
    assert crossing, "the sweep should contain cross-node tensor-parallel layouts"
    assert all(c.allow_cross_node_tensor_parallel and c.devices_per_node % c.tensor_parallel_size for c in crossing)


def test_pipeline_stages_are_the_outermost_axis():
    for config in CONFIGS:
        block = config.world_size // config.pipeline_parallel_size
        for rank in range(config.world_size):
            stage, _, _ = config.coordinates(rank)
            # Each stage owns one contiguous block of ranks, so stages span nodes while tp and dp stay inside.
            assert stage == rank // block, config


def test_data_parallel_sits_between_tensor_and_pipeline():
    for config in CONFIGS:
        pp, dp, tp = config.mesh_shape
        for rank in range(config.world_size):
            assert config.coordinates(rank) == (rank // (dp * tp), (rank // tp) % dp, rank % tp)


def test_coordinates_match_the_row_major_layout_of_init_device_mesh_and_invert():
    for config in CONFIGS:
        mesh = torch.arange(config.world_size).reshape(config.mesh_shape)
        for rank in range(config.world_size):
            coordinate = config.coordinates(rank)
            assert int(mesh[coordinate]) == rank, config
            assert config.rank_at(*coordinate) == rank


def test_unknown_axis_and_out_of_range_rank_are_refused():
    config = ParallelConfig(tensor_parallel_size=2, devices_per_node=4)
    with pytest.raises(ValueError, match="axis='tp'"):
        config.ranks_of_group("tp", 0)
    with pytest.raises(ValueError, match="rank=4"):
        config.coordinates(4)


def test_building_a_mesh_without_a_process_group_is_refused():
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_device_mesh(ParallelConfig(devices_per_node=1), "cpu")


def _check_meshes(rank: int, world_size: int) -> None:
    # Every layout of 4 ranks on 2 nodes x 2 devices whose tensor-parallel groups stay inside a node.
    for tp in (1, 2):
        for pp in (1, 2, 4):
            if world_size % (tp * pp):
                continue
            config = ParallelConfig(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, num_nodes=2, devices_per_node=2, owner="ElasticFT3D"
            )
            mesh = build_device_mesh(config, "cpu")
            assert mesh.mesh_dim_names == MESH_DIM_NAMES
            assert tuple(mesh.shape) == config.mesh_shape
            assert tuple(mesh.get_coordinate()) == config.coordinates(rank), (config, mesh.get_coordinate())
            for axis in AXES:
                group_ranks = dist.get_process_group_ranks(mesh[axis].get_group())
                assert group_ranks == config.ranks_of_group(axis, rank), (config, axis)
            # Modules written for Lightning's ModelParallelStrategy index these two names.
            assert mesh["data_parallel"].size() == config.data_parallel_size
            assert mesh["tensor_parallel"].size() == config.tensor_parallel_size
    wrong = ParallelConfig(num_nodes=1, devices_per_node=8)
    try:
        build_device_mesh(wrong, "cpu")
    except ValueError as error:
        assert "has 4 ranks but the config describes 8" in str(error)
    else:
        raise AssertionError("a config for 8 ranks was accepted on 4")


def test_device_mesh_coordinates_and_groups_match_the_config_on_four_gloo_processes():
    run_distributed(_check_meshes, 4)
