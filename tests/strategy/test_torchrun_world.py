"""Under torchrun, ElasticFT3D trains on the processes torchrun started, whatever ``devices`` and ``num_nodes``
Lightning derived from the Trainer's defaults (one device on a CPU machine, one node)."""

from __future__ import annotations

import logging

import lightning as L
import pytest

from lightning_ft import ElasticFT3D
from lightning_ft.strategy.torchrun_world import torchrun_shape
from tests.helpers import free_port
from tests.strategy.models import TinyRegressor


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process as torchrun would start it: set ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` in the test."""

    def launch(world_size: int, local_world_size: int) -> None:
        env = {
            "TORCHELASTIC_RUN_ID": "test",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return launch


def _trainer(**kwargs):
    return L.Trainer(strategy=ElasticFT3D(), logger=False, enable_progress_bar=False, **kwargs)


def test_lightnings_defaults_follow_torchruns_processes_per_node_and_nodes(torchrun_env, caplog):
    torchrun_env(world_size=4, local_world_size=2)
    caplog.set_level(logging.INFO)
    trainer = _trainer()  # accelerator="auto", devices="auto", num_nodes=1: one CPU device on one node
    strategy = trainer.strategy
    assert (trainer.num_devices, trainer.num_nodes, trainer.world_size) == (2, 2, 4)
    # The check Lightning's launcher makes before anything runs, which failed with the Trainer's own numbers.
    strategy.cluster_environment.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)


def test_nothing_changes_when_the_trainer_already_matches_torchrun(torchrun_env):
    torchrun_env(world_size=2, local_world_size=2)
    assert (_trainer(accelerator="cpu", devices=2).num_devices, torchrun_shape()) == (2, (2, 1))


def test_nothing_changes_outside_torchrun():
    assert torchrun_shape() is None
    assert _trainer(accelerator="cpu", devices=1).num_devices == 1


def test_nodes_with_different_process_counts_are_left_to_lightning(torchrun_env):
    torchrun_env(world_size=3, local_world_size=2)
    assert torchrun_shape() is None
    assert _trainer(accelerator="cpu", devices=1).num_devices == 1


def test_a_one_process_torchrun_trains_even_if_the_trainer_asked_for_two_devices(torchrun_env, tmp_path):
    torchrun_env(world_size=1, local_world_size=1)
    trainer = _trainer(accelerator="cpu", devices=2, max_steps=1, default_root_dir=tmp_path)
    trainer.fit(TinyRegressor())
    assert trainer.global_step == 1 and trainer.world_size == 1


def test_a_trainer_num_nodes_other_than_torchruns_is_replaced_with_one_line_saying_so(torchrun_env, monkeypatch):
    # The setter takes torchrun's node count at once, so comparing with it afterwards never saw a difference.
    import lightning_ft.strategy.elastic_ft3d as elastic_ft3d

    said: list[str] = []
    monkeypatch.setattr(elastic_ft3d, "rank_zero_info", said.append)
    torchrun_env(world_size=2, local_world_size=2)
    trainer = _trainer(accelerator="cpu", devices=2, num_nodes=2)
    assert (trainer.num_devices, trainer.num_nodes) == (2, 1)
    trainer.strategy.set_world_ranks()  # again, as setup_distributed does: the line is said once
    assert said == [
        "lightning-ft: torchrun started 2 process(es) per node on 1 node(s); training on 2 CPU process(es) per node,"
        " not on the Trainer's 2 device(s) x 2 node(s)"
    ]
