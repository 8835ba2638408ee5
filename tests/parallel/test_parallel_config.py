"""ParallelConfig: size inference, validation before any process group exists, and the errors users see."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lightning_ft.parallel.parallel_config import ClusterShape, ParallelConfig


def test_data_parallel_size_auto_is_the_world_divided_by_tensor_and_pipeline():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, num_nodes=2, devices_per_node=4)
    # world 2 x 4 = 8, dp = 8 / (2 x 2)
    assert config.data_parallel_size == 2
    assert config.mesh_shape == (2, 2, 2)
    assert ParallelConfig(data_parallel_size=None, devices_per_node=4).data_parallel_size == 4


def test_tensor_parallel_size_auto_means_devices_per_node_as_in_lightning():
    config = ParallelConfig(tensor_parallel_size="auto", num_nodes=3, devices_per_node=4)
    assert config.tensor_parallel_size == 4
    assert config.data_parallel_size == 3
    assert config.world_size == 12


def test_explicit_sizes_that_multiply_to_the_world_size_are_kept():
    config = ParallelConfig(
        data_parallel_size=2, tensor_parallel_size=4, pipeline_parallel_size=2, num_nodes=2, devices_per_node=8
    )
    assert (config.data_parallel_size, config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 4, 2)


def test_tensor_size_not_dividing_the_world_names_the_option_the_value_and_the_world_size():
    with pytest.raises(
        ValueError, match=re.escape("ElasticFT3D(tensor_parallel_size=3): 3 does not divide the world size 8")
    ):
        ParallelConfig(tensor_parallel_size=3, devices_per_node=8, owner="ElasticFT3D")


def test_pipeline_size_not_dividing_the_world_is_refused():
    with pytest.raises(
        ValueError, match=re.escape("ElasticFT3D(pipeline_parallel_size=3): 3 does not divide the world size 8")
    ):
        ParallelConfig(pipeline_parallel_size=3, num_nodes=2, devices_per_node=4, owner="ElasticFT3D")


def test_sizes_whose_product_is_not_the_world_size_name_every_option_and_value():
    with pytest.raises(ValueError) as error:
        ParallelConfig(
            data_parallel_size=4,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            devices_per_node=8,
            owner="ElasticFT3D",
        )
    message = str(error.value)
    assert message.startswith("ElasticFT3D(data_parallel_size=4, tensor_parallel_size=2, pipeline_parallel_size=2)")
    assert "4 x 2 x 2 = 16 does not equal the world size 8" in message
    assert 'data_parallel_size="auto" would be 2' in message


def test_tensor_and_pipeline_together_must_divide_the_world():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4, pipeline_parallel_size=4\): 4 x 4 = 16 does not divide"
    ):
        ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=4, num_nodes=1, devices_per_node=8)


def test_tensor_parallel_across_nodes_says_how_much_slower_the_link_is_and_what_to_choose():
    with pytest.raises(ValueError) as error:
        ParallelConfig(
            tensor_parallel_size=16,
            num_nodes=2,
            devices_per_node=8,
            intra_node_bandwidth_bytes_per_s=900e9,
            inter_node_bandwidth_bytes_per_s=50e9,
            owner="ElasticFT3D",
        )
    message = str(error.value)
    assert message.startswith("ElasticFT3D(tensor_parallel_size=16):")
    assert "about 18x slower" in message  # 900 / 50
    assert "900 GB/s" in message and "50 GB/s" in message
    assert "tensor_parallel_size=8 with pipeline_parallel_size=2" in message  # 16 = 8 inside a node x 2 across
    assert "allow_cross_node_tensor_parallel=True" in message


def test_tensor_groups_that_straddle_a_node_boundary_are_refused_too():
    # 12 ranks on nodes of 4: the second group of 3 consecutive ranks is ranks 3-5, on nodes 0 and 1.
    with pytest.raises(ValueError, match="straddle nodes of 4 devices"):
        ParallelConfig(tensor_parallel_size=3, num_nodes=3, devices_per_node=4)


def test_cross_node_tensor_parallel_is_accepted_with_the_override():
    config = ParallelConfig(
        tensor_parallel_size=16, num_nodes=2, devices_per_node=8, allow_cross_node_tensor_parallel=True
    )
    assert config.mesh_shape == (1, 1, 16)
    assert {config.node_of(rank) for rank in config.ranks_of_group("tensor_parallel", 0)} == {0, 1}


def test_heads_must_divide_by_the_tensor_parallel_size_when_the_model_is_given():
    with pytest.raises(ValueError) as error:
        ParallelConfig(tensor_parallel_size=8, devices_per_node=8, num_heads=12, owner="ElasticFT3D")
    message = str(error.value)
    assert message.startswith("ElasticFT3D(tensor_parallel_size=8): the model's 12 attention heads")
    assert "1, 2, 4" in message  # divisors of 12 that also divide 8


def test_layers_must_divide_by_the_pipeline_parallel_size_when_the_model_is_given():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4\): the model's 10 layers"):
        ParallelConfig(pipeline_parallel_size=4, devices_per_node=8, num_layers=10)
    assert ParallelConfig(pipeline_parallel_size=2, devices_per_node=8, num_layers=10).pipeline_parallel_size == 2


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        (dict(tensor_parallel_size="4"), TypeError, r"tensor_parallel_size='4'\): expected a positive int or \"auto\""),
        (dict(pipeline_parallel_size="auto"), TypeError, r"pipeline_parallel_size='auto'\): expected a positive int"),
        (dict(data_parallel_size=0), ValueError, r"data_parallel_size=0\): must be at least 1"),
        (dict(tensor_parallel_size=True), TypeError, "tensor_parallel_size=True"),
        (dict(num_nodes=0), ValueError, r"num_nodes=0\): must be at least 1"),
        (dict(allow_cross_node_tensor_parallel="yes"), TypeError, "allow_cross_node_tensor_parallel='yes'"),
    ],
)
def test_malformed_options_are_refused_with_their_name(options, error, pattern):
    with pytest.raises(error, match=pattern):
        ParallelConfig(**{"devices_per_node": 4, "owner": "ElasticFT3D", **options})


def test_without_an_owner_the_message_starts_with_the_options():
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=3: 3 does not divide"):
        ParallelConfig(tensor_parallel_size=3, devices_per_node=4, owner=None)


def test_config_built_for_a_cluster_takes_its_shape_and_links():
    cluster = ClusterShape(num_nodes=2, devices_per_node=4, inter_node_bandwidth_bytes_per_s=25e9)
    config = ParallelConfig.for_cluster(cluster, tensor_parallel_size=4)
    assert config.cluster == cluster
    assert config.world_size == cluster.world_size == 8
    assert config.data_parallel_size == 2


def test_cluster_shape_refuses_a_non_positive_bandwidth():
    with pytest.raises(ValueError, match=r"ClusterShape\(inter_node_bandwidth_bytes_per_s=0\)"):
        ClusterShape(devices_per_node=8, inter_node_bandwidth_bytes_per_s=0)


def test_configs_with_equal_sizes_compare_equal_whoever_built_them():
    a = ParallelConfig(tensor_parallel_size="auto", devices_per_node=4, owner="ElasticFT3D")
    b = ParallelConfig(data_parallel_size=1, tensor_parallel_size=4, devices_per_node=4)
    assert a == b


def test_config_holds_the_cluster_it_is_given_and_reads_its_shape_through_it():
    cluster = ClusterShape(num_nodes=2, devices_per_node=4, intra_node_bandwidth_bytes_per_s=300e9)
    config = ParallelConfig(tensor_parallel_size=4, cluster=cluster)
    assert config.cluster is cluster
    assert (config.num_nodes, config.devices_per_node, config.world_size) == (2, 4, 8)
    assert config.intra_node_bandwidth_bytes_per_s == 300e9
    assert config.inter_node_bandwidth_bytes_per_s == cluster.inter_node_bandwidth_bytes_per_s
    assert config == ParallelConfig.for_cluster(cluster, tensor_parallel_size=4)


def test_a_cluster_given_by_its_parts_equals_the_same_cluster_given_whole():
    by_parts = ParallelConfig(
        tensor_parallel_size=2, num_nodes=2, devices_per_node=4, inter_node_bandwidth_bytes_per_s=25e9
    )
    whole = ParallelConfig(
        tensor_parallel_size=2,
        cluster=ClusterShape(num_nodes=2, devices_per_node=4, inter_node_bandwidth_bytes_per_s=25e9),
    )
    assert by_parts == whole and hash(by_parts) == hash(whole)
    assert by_parts.cluster == whole.cluster
    assert ParallelConfig(devices_per_node=8).cluster == ClusterShape(num_nodes=1, devices_per_node=8)


def test_the_shape_is_stored_once_so_replace_can_move_a_config_to_another_cluster():
    config = ParallelConfig(tensor_parallel_size=2, num_nodes=1, devices_per_node=4)
    bigger = dataclasses.replace(
        config, data_parallel_size="auto", cluster=ClusterShape(num_nodes=2, devices_per_node=4)
    )
    assert (bigger.num_nodes, bigger.world_size, bigger.data_parallel_size) == (2, 8, 4)
    assert "num_nodes" not in {f.name for f in dataclasses.fields(ParallelConfig)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cluster = bigger.cluster  # type: ignore[misc]


def test_cluster_given_both_whole_and_by_parts_or_not_at_all_is_refused():
    cluster = ClusterShape(devices_per_node=4)
    with pytest.raises(TypeError, match=r"ElasticFT3D\(cluster=.*num_nodes=2\): give the cluster either as"):
        ParallelConfig(cluster=cluster, num_nodes=2, owner="ElasticFT3D")
    with pytest.raises(TypeError, match=r"missing devices_per_node"):
        ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(
        TypeError, match=r"ParallelConfig\(cluster=\{'devices_per_node': 4\}\): expected a ClusterShape"
    ):
        ParallelConfig(cluster={"devices_per_node": 4})


def test_a_bad_bandwidth_part_names_the_owner_the_user_called():
    with pytest.raises(ValueError, match=r"^ElasticFT3D\(intra_node_bandwidth_bytes_per_s=-1\.0\): must be a positive"):
        ParallelConfig(devices_per_node=4, intra_node_bandwidth_bytes_per_s=-1.0, owner="ElasticFT3D")
