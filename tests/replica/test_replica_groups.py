"""``ReplicaGroups``: validated at construction, defaults resolved from torchft's environment variables."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_ft import ElasticFT3D, ReplicaGroups


def test_defaults_come_from_torchft_s_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    resolved = ReplicaGroups().resolved()
    assert (resolved.lighthouse, resolved.replica_id, resolved.num_groups, resolved.data_part) == (
        "http://lighthouse:29510",
        "2",
        3,
        2,
    )
    given = ReplicaGroups(lighthouse="http://127.0.0.1:1234", replica_id="a", num_groups=2).resolved()
    assert (given.lighthouse, given.replica_id, given.num_groups, given.data_part) == (
        "http://127.0.0.1:1234",
        "a",
        2,
        0,
    )
    assert resolved.num_groups_known and given.num_groups_known
    # Neither given nor in the environment: 1 for the data, and the ElasticPolicy knows it is a default (it needs the
    # full membership to scale, tests/elastic/test_replica_policy.py).
    monkeypatch.delenv("NUM_REPLICA_GROUPS")
    unknown = ReplicaGroups().resolved()
    assert (unknown.num_groups, unknown.num_groups_known) == (1, False)


def test_one_timeout_sets_the_others() -> None:
    resolved = ReplicaGroups(lighthouse="http://h:1", replica_id="0", timeout=timedelta(seconds=2)).resolved()
    assert resolved.quorum_timeout == timedelta(seconds=24)
    assert resolved.first_quorum_timeout == timedelta(minutes=10)
    assert resolved.heartbeat_interval == timedelta(milliseconds=100)
    assert resolved.connect_timeout == timedelta(seconds=10)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"lighthouse": "lighthouse:29510"}, ValueError, ["lighthouse='lighthouse:29510'", "http://host:port"]),
        ({"min_replicas": 0}, ValueError, ["min_replicas=0", ">= 1"]),
        ({"min_replicas": 2.0}, TypeError, ["min_replicas=2.0", "int"]),
        ({"min_replicas": 3, "num_groups": 2}, ValueError, ["min_replicas=3, num_groups=2", "<= num_groups"]),
        ({"timeout": 5}, TypeError, ["timeout=5", "timedelta"]),
        ({"timeout": timedelta(0)}, ValueError, ["timeout=", "positive"]),
        ({"replica_id": "a:b"}, ValueError, ["replica_id='a:b'", "letters, digits"]),
        ({"address": " "}, ValueError, ["address=' '", "host name or IP"]),
        ({"process_group": "mpi"}, ValueError, ["process_group='mpi'", "'gloo', 'nccl', 'baby_nccl'"]),
    ],
)
def test_a_bad_option_is_refused_at_construction_naming_option_value_and_rule(
    kwargs: dict, error: type, words: list[str]
) -> None:
    with pytest.raises(error) as raised:
        ReplicaGroups(**kwargs)
    assert all(w in str(raised.value) for w in words), str(raised.value)


def test_a_missing_lighthouse_or_id_is_refused_with_the_variable_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE"):
        ReplicaGroups(replica_id="0").resolved()
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID"):
        ReplicaGroups(lighthouse="http://h:1").resolved()
    monkeypatch.setenv("REPLICA_GROUP_ID", "x y")
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID='x y'"):
        ReplicaGroups(lighthouse="http://h:1").resolved()


def test_the_strategy_takes_replica_groups_with_data_or_tensor_parallel_but_not_pipeline_parallel() -> None:
    groups = ReplicaGroups(lighthouse="http://h:1")
    assert ElasticFT3D(replica_groups=groups).replica_groups is groups
    assert ElasticFT3D(replica_groups=groups, tensor_parallel_size=2).replica_groups is groups
    with pytest.raises(TypeError, match="replica_groups"):
        ElasticFT3D(replica_groups={"lighthouse": "http://h:1"})
    with pytest.raises(ValueError) as refused:
        ElasticFT3D(replica_groups=groups, pipeline_parallel_size=2)
    assert str(refused.value) == (
        "ElasticFT3D(replica_groups=..., pipeline_parallel_size=2): replica groups support data parallel, FSDP2 and"
        " tensor parallel inside a group, not pipeline parallel (pipeline_parallel_size=1)"
    )
