"""``ReplicaGroups(process_group=...)`` at the strategy's set-up: an NCCL process group across groups needs CUDA."""

from __future__ import annotations

import pytest

from lightning_ft import ElasticFT3D, ReplicaGroups


def test_an_nccl_process_group_across_groups_is_refused_on_cpu_before_any_step(tmp_path) -> None:
    from tests.strategy.models import TinyRegressor, make_trainer

    groups = ReplicaGroups(lighthouse="http://127.0.0.1:1", replica_id="0", process_group="nccl")
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(replica_groups=groups, fault=None), max_steps=1)
    with pytest.raises(ValueError) as refused:
        trainer.fit(TinyRegressor())
    assert str(refused.value) == (
        "ReplicaGroups(process_group='nccl'): NCCL needs a CUDA device on every rank, this run's is 'cpu'; use"
        " process_group='gloo'"
    )
    assert trainer.global_step == 0
