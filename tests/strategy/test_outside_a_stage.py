"""What ``ElasticFT3D`` answers on a ``Trainer`` that has not started ``fit``/``validate``/``test``/``predict``: the
questions ``DDPStrategy`` answers there too (Lightning's own tests ask them), found by running Lightning's tests
(benchmarks/lightning_compat.py)."""

from __future__ import annotations

import pytest

from lightning_ft import ElasticFT3D
from tests.strategy.models import make_trainer


def test_sampler_arguments_before_the_mesh_exists_are_those_of_ddp(tmp_path):
    trainer = make_trainer(tmp_path)
    # Lightning reads them when it prepares a loader outside a stage (a loop's setup_data()).
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_sampler_arguments_with_tensor_parallelism_need_the_mesh(tmp_path):
    # The data-parallel group is then a part of the world that only the mesh knows.
    strategy = ElasticFT3D(tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="device mesh before processes have initialized"):
        strategy.distributed_sampler_kwargs  # noqa: B018 - the property is what is tested
