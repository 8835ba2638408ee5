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

order = sys.argv.pop(1)
if order == "lightning_ft first":
    import lightning_ft  # noqa: F401 - the one import line the docs give; Lightning is not imported yet
from lightning.pytorch.cli import LightningCLI

if order == "lightning_ft after lightning":
    import lightning_ft  # noqa: F401
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


@pytest.mark.parametrize("order", ["lightning_ft first", "lightning_ft after lightning"])
@pytest.mark.parametrize("flag", ["--trainer.strategy=elastic_ft3d", "--trainer.strategy=lightning_ft.ElasticFT3D"])
def test_a_lightning_cli_script_names_the_strategy_after_import_lightning_ft(tmp_path, order, flag):
    # A fresh process, as a user's train.py: `import lightning_ft`, before or after Lightning, registers the names.
    proc = _run_cli_script(tmp_path, order, flag)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ElasticFT3D"


def test_the_class_path_form_needs_no_import(tmp_path):
    # jsonargparse imports the class itself.
    proc = _run_cli_script(tmp_path, "no import", "--trainer.strategy.class_path=lightning_ft.ElasticFT3D")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ElasticFT3D"


_TRAINER_SCRIPT = """
import sys

import lightning_ft

assert "lightning" not in sys.modules and "torch" not in sys.modules, "import lightning_ft imported Lightning or torch"
import lightning as L

trainer = L.Trainer(strategy="elastic_ft3d", accelerator="cpu", devices=1, logger=False)
print(type(trainer.strategy) is lightning_ft.ElasticFT3D)
"""


def test_import_lightning_ft_alone_lets_a_trainer_take_the_short_name_without_importing_lightning_itself():
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINER_SCRIPT],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
