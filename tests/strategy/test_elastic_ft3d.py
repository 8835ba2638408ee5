"""ElasticFT3D: it refuses bad options with a clear error before any work starts, is configurable from YAML, and
drives its collaborators from Lightning's hooks in the order the table of lightning_ft/strategy/elastic_ft3d.py says."""

from __future__ import annotations

import copy
import functools
import textwrap

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_ft import ElasticFT3D, ElasticPolicy, FaultPolicy
from lightning_ft.elastic.dataloader import TrainingDataPosition
from lightning_ft.fault.fault_handler import FaultHandler
from lightning_ft.strategy.auto_resume import AutoResume
from lightning_ft.strategy.checkpoint_io import StrategyCheckpoints
from lightning_ft.strategy.elastic_resume import ElasticResume
from lightning_ft.strategy.parallel_modes import DataParallelMode
from lightning_ft.strategy.restore_order import RestoreOrder
from lightning_ft.strategy.tracker import TrainingTracker
from tests.helpers import as_a_new_process
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


# ---------------------------------------------------------------------------------------------------- lifecycle

HOOKS = (
    "setup_environment",
    "_prepare",
    "setup",
    "load_checkpoint",
    "process_dataloader",
    "on_train_start",
    "optimizer_step",
    "save_checkpoint",
    "remove_checkpoint",
    "on_exception",
    "teardown",
)
COLLABORATORS = {
    "checkpoints": (
        StrategyCheckpoints,
        ("open", "defer_logger_calls", "save", "load", "remove", "cleanup_leftovers", "close", "finish_logger_calls"),
    ),
    "auto_resume": (AutoResume, ("install", "select", "take_fallbacks", "uninstall")),
    "tracker": (TrainingTracker, ("__init__", "resume_with_rng")),
    "data_position": (TrainingDataPosition, ("prepare_for",)),
    "fault": (FaultHandler, ("install", "start", "preflight")),
    "elastic_resume": (ElasticResume, ("checkpoint_loaded", "on_train_start", "optimizer_step", "metadata", "finish")),
    "mode": (DataParallelMode, ("setup", "optimizer_step", "teardown")),
    "restore_order": (RestoreOrder, ("install", "after_setup", "uninstall")),
    # Lightning's own restore, to hold where it comes among the strategy's calls.
    "lightning": (_CheckpointConnector, ("restore_model", "restore_callbacks", "restore_training_state")),
}

# The table of lightning_ft/strategy/elastic_ft3d.py, as (the strategy hook running, the collaborator's call), each
# at its first occurrence in a resumed fit (data parallel). "(Lightning)" is a call Lightning makes outside the
# strategy's hooks: the patched checkpoint connector, its restore steps, or a callback hook of the strategy's own
# callbacks. Lightning's order, as under DDPStrategy: module and callback state restored before the strategy's setup
# (and so before on_fit_start), the training state (loops, optimizers, schedulers) after it.
RESUMED_FIT = [
    ("setup_environment", "fault.install"),
    ("setup_environment", "checkpoints.open"),
    ("setup_environment", "checkpoints.defer_logger_calls"),
    ("setup_environment", "tracker.__init__"),
    ("setup_environment", "auto_resume.install"),
    ("setup_environment", "restore_order.install"),
    ("_prepare", "fault.start"),
    ("(Lightning)", "auto_resume.select"),
    ("load_checkpoint", "auto_resume.take_fallbacks"),
    ("load_checkpoint", "checkpoints.load"),
    ("load_checkpoint", "elastic_resume.checkpoint_loaded"),
    ("load_checkpoint", "tracker.resume_with_rng"),
    ("(Lightning)", "lightning.restore_model"),
    ("(Lightning)", "lightning.restore_callbacks"),
    ("setup", "mode.setup"),
    ("setup", "fault.preflight"),
    ("setup", "restore_order.after_setup"),
    ("(Lightning)", "lightning.restore_training_state"),
    ("process_dataloader", "data_position.prepare_for"),
    ("(Lightning)", "elastic_resume.on_train_start"),
    ("on_train_start", "checkpoints.cleanup_leftovers"),
    ("optimizer_step", "elastic_resume.optimizer_step"),
    ("optimizer_step", "mode.optimizer_step"),
    ("save_checkpoint", "elastic_resume.metadata"),
    ("save_checkpoint", "checkpoints.save"),
    ("remove_checkpoint", "checkpoints.remove"),
    ("teardown", "checkpoints.close"),
    ("teardown", "checkpoints.finish_logger_calls"),
    ("teardown", "auto_resume.uninstall"),
    ("teardown", "restore_order.uninstall"),
    ("teardown", "mode.teardown"),
    ("teardown", "elastic_resume.finish"),
]


def _record_lifecycle(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Wrap the strategy's hooks and its collaborators' methods so that each call is recorded with the hook it ran in;
    every call still does its work (a real Trainer trains)."""
    calls: list[tuple[str, str]] = []
    running: list[str] = []

    def wrap_hook(name: str) -> None:
        original = getattr(ElasticFT3D, name)

        @functools.wraps(original)
        def hook(self, *args, **kwargs):
            running.append(name)
            try:
                return original(self, *args, **kwargs)
            finally:
                running.pop()

        monkeypatch.setattr(ElasticFT3D, name, hook)

    def wrap_call(label: str, cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def call(self, *args, **kwargs):
            calls.append((running[-1] if running else "(Lightning)", f"{label}.{name}"))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    for name in HOOKS:
        wrap_hook(name)
    for label, (cls, names) in COLLABORATORS.items():
        for name in names:
            wrap_call(label, cls, name)
    return calls


def _first_occurrences(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(calls))


def test_a_resumed_fit_drives_the_collaborators_in_the_order_of_the_lifecycle_table(tmp_path, monkeypatch):
    def checkpoints() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=1)

    make_trainer(tmp_path, callbacks=[checkpoints()], max_steps=2, limit_val_batches=0).fit(TinyRegressor())
    as_a_new_process()  # the relaunch
    calls = _record_lifecycle(monkeypatch)
    make_trainer(tmp_path, callbacks=[checkpoints()], max_steps=4, limit_val_batches=0).fit(TinyRegressor())
    assert _first_occurrences(calls) == RESUMED_FIT, _first_occurrences(calls)


def test_a_copied_strategy_gets_a_fresh_run_and_keeps_its_configuration(tmp_path):
    strategy = ElasticFT3D(fault=FaultPolicy(health_checks=False))
    make_trainer(tmp_path, strategy=strategy, max_steps=1).fit(TinyRegressor())
    assert strategy.event_log is not None and strategy._tracker is not None, "the run was set up"
    copied = copy.deepcopy(strategy)
    assert copied._run is not strategy._run
    assert (copied.event_log, copied._tracker, copied._checkpoints) == (None, None, None)
    assert copied._elastic_resume is not strategy._elastic_resume
    assert (copied.fault, copied.elastic, copied.auto_resume) == (strategy.fault, strategy.elastic, True)


def test_a_trainer_that_fit_can_be_saved_with_torch_save_and_loaded(tmp_path):
    # The run's hooks (the tracker's, on the swapped-in sampler of the training loader) stay with the run.
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(TinyRegressor())
    torch.save(trainer, tmp_path / "trainer.pt")
    loaded = torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert isinstance(loaded.strategy, ElasticFT3D) and loaded.global_step == 2


def test_a_checkpoint_callback_double_without_a_dirpath_attribute_trains(tmp_path):
    # Lightning's own tests pass a Mock(spec=ModelCheckpoint): an instance of the class whose instance attributes
    # (dirpath) do not exist. Lightning never reads them there; neither may the strategy.
    from unittest.mock import Mock

    double = Mock(spec=ModelCheckpoint)
    trainer = make_trainer(tmp_path, callbacks=[double], max_steps=2)
    trainer.fit(TinyRegressor())
    assert trainer.global_step == 2 and double.on_train_end.called
