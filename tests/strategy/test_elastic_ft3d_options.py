"""ElasticFT3D refuses bad options with a clear error before any work starts, and is configurable from YAML."""

from __future__ import annotations

import textwrap

import pytest
import torch.distributed as dist

from lightning_ft import ElasticFT3D, ElasticPolicy, FaultPolicy
from tests.strategy.models import TinyRegressor, make_trainer


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"data_parallel_size": 0}, ValueError, "ElasticFT3D(data_parallel_size=0): must be at least 1"),
        ({"tensor_parallel_size": -2}, ValueError, "ElasticFT3D(tensor_parallel_size=-2): must be at least 1"),
        # The same mistake gets the same exception type here as from ParallelConfig: a wrong type is a TypeError.
        ({"pipeline_parallel_size": "auto"}, TypeError, "ElasticFT3D(pipeline_parallel_size='auto'): expected"),
        ({"data_parallel_size": 2.0}, TypeError, "ElasticFT3D(data_parallel_size=2.0): expected"),
        ({"pipeline_schedule": "zigzag"}, ValueError, "ElasticFT3D(pipeline_schedule='zigzag'): must be one of"),
        ({"num_microbatches": 0}, ValueError, "ElasticFT3D(num_microbatches=0): must be at least 1"),
    ],
)
def test_invalid_sizes_are_refused_at_construction_naming_the_option(kwargs, error, message):
    with pytest.raises(error) as raised:
        ElasticFT3D(**kwargs)
    assert message in str(raised.value)


def test_policy_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="elastic="):
        ElasticFT3D(elastic={"batch": "keep_local"})


def test_sizes_that_do_not_multiply_to_the_world_size_fail_before_process_groups_start(tmp_path):
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(data_parallel_size=2), max_steps=1)
    with pytest.raises(ValueError, match="data_parallel_size") as err:
        trainer.fit(TinyRegressor())
    assert "does not equal the world size 1 (1 node x 1 devices per node)" in str(err.value)
    assert not dist.is_initialized()


def test_auto_tensor_parallel_on_one_device_trains_as_data_parallel(tmp_path):
    trainer = make_trainer(tmp_path, strategy=ElasticFT3D(tensor_parallel_size="auto"), max_steps=1)
    # tp="auto" on one device is 1, so the module trains as DDP; a real tp>1 needs >1 device, tested in test_tp.
    trainer.fit(TinyRegressor())
    assert trainer.global_step == 1


def test_every_plugin_is_configurable_from_a_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            trainer:
              accelerator: cpu
              devices: 1
              max_steps: 1
              default_root_dir: {tmp_path}
              strategy:
                class_path: lightning_ft.ElasticFT3D
                init_args:
                  data_parallel_size: auto
                  tensor_parallel_size: 1
                  auto_resume: false
                  elastic:
                    class_path: lightning_ft.ElasticPolicy
                    init_args:
                      batch: keep_local
                      lr_scaling: sqrt
                  fault:
                    class_path: lightning_ft.FaultPolicy
                    init_args:
                      grace_s: 10.0
              callbacks:
                - class_path: lightning_ft.StragglerMonitor
                - class_path: lightning_ft.ThermalMonitor
                - class_path: lightning_ft.GoodputMonitor
            """
        )
    )
    cli = LightningCLI(TinyRegressor, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ElasticFT3D)
    assert strategy.auto_resume is False
    assert strategy.elastic == ElasticPolicy(batch="keep_local", lr_scaling="sqrt")
    assert isinstance(strategy.fault, FaultPolicy) and strategy.fault.grace_s == 10.0
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {"StragglerMonitor", "ThermalMonitor", "GoodputMonitor"} <= names


def test_gradient_accumulation_scheduler_with_keep_global_is_refused_before_training(tmp_path):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer = make_trainer(tmp_path, callbacks=[GradientAccumulationScheduler({0: 2})], max_steps=1)
    with pytest.raises(ValueError, match="keep_global.*GradientAccumulationScheduler"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0
    keep_local = ElasticFT3D(elastic=ElasticPolicy(batch="keep_local"))
    trainer = make_trainer(
        tmp_path, strategy=keep_local, callbacks=[GradientAccumulationScheduler({0: 2})], max_steps=1
    )
    trainer.fit(TinyRegressor())
    assert trainer.global_step == 1
