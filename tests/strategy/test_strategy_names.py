"""ElasticFT3D by name: Lightning's strategy registry, LightningCLI flags and YAML, and what the README tells a
LightningCLI user to write."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import lightning as L
import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_ft import ElasticFT3D, ElasticPolicy
from lightning_ft.strategy.registry import STRATEGY_NAMES
from tests.helpers import REPO_ROOT, subprocess_env
from tests.strategy.models import TinyRegressor


def _trainer(strategy):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)


@pytest.mark.parametrize("name", ["elastic_ft3d", "lightning_ft.ElasticFT3D", "lightning_ft.strategy.ElasticFT3D"])
def test_a_trainer_accepts_the_strategy_by_name(name):
    strategy = _trainer(name).strategy
    assert type(strategy) is ElasticFT3D
    assert strategy.elastic == ElasticPolicy() and strategy.auto_resume is True


def test_the_find_unused_parameters_name_passes_it_to_ddp():
    assert _trainer("elastic_ft3d_find_unused_parameters_true").strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert _trainer("elastic_ft3d").strategy._ddp_kwargs == {}


def test_registering_leaves_lightnings_own_names_alone():
    assert type(_trainer("ddp").strategy) is DDPStrategy
    assert set(STRATEGY_NAMES) <= set(StrategyRegistry.available_strategies())
    assert ElasticFT3D.strategy_name == "elastic_ft3d"


@pytest.mark.parametrize(
    "flags",
    [
        ["--trainer.strategy=elastic_ft3d"],
        ["--trainer.strategy=lightning_ft.ElasticFT3D"],
        ["--trainer.strategy.class_path=lightning_ft.ElasticFT3D", "--trainer.strategy.init_args.auto_resume=false"],
    ],
)
def test_lightning_cli_flags_select_the_strategy(tmp_path, flags):
    args = [*flags, "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}"]
    cli = LightningCLI(TinyRegressor, run=False, args=args, save_config_callback=None)
    assert type(cli.trainer.strategy) is ElasticFT3D
    assert cli.trainer.strategy.auto_resume is ("auto_resume=false" not in flags[-1])


def test_a_lightning_cli_yaml_file_selects_the_strategy_by_name(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            """
            trainer:
              accelerator: cpu
              devices: 1
              strategy: elastic_ft3d
            """
        )
    )
    cli = LightningCLI(TinyRegressor, run=False, args=["--config", str(config)], save_config_callback=None)
    assert type(cli.trainer.strategy) is ElasticFT3D


_CLI_SCRIPT = """
import sys

from lightning.pytorch.cli import LightningCLI

if sys.argv.pop(1) == "with-import":
    import lightning_ft.strategy  # noqa: F401 - registers "elastic_ft3d" and "lightning_ft.ElasticFT3D"
from tests.strategy.models import TinyRegressor

cli = LightningCLI(TinyRegressor, run=False, save_config_callback=None)
print(type(cli.trainer.strategy).__name__)
"""


def _run_cli_script(tmp_path, *args):
    script = tmp_path / "cli.py"
    script.write_text(_CLI_SCRIPT)
    flags = ["--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}"]
    return subprocess.run(
        [sys.executable, str(script), *args, *flags],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_lightning_cli_script_names_the_strategy_after_the_one_import_line_the_docs_give(tmp_path):
    # A fresh process, as a user's train.py: the names exist once lightning_ft.strategy is imported.
    proc = _run_cli_script(tmp_path, "with-import", "--trainer.strategy=lightning_ft.ElasticFT3D")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ElasticFT3D"
    # The class_path form needs no import: jsonargparse imports the class.
    proc = _run_cli_script(tmp_path, "without", "--trainer.strategy.class_path=lightning_ft.ElasticFT3D")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ElasticFT3D"
