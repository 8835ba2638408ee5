"""A ``CheckpointIO`` plugin the user gives the Trainer (``plugins=[...]``), under ``ElasticFT3D`` and ``DDPStrategy``.

- Its ``load_checkpoint`` reads every checkpoint file a stage loads, as under ``DDPStrategy`` (darts' plugin allows
  darts' classes that way): a lightning-ft file and another strategy's ``.ckpt``. lightning-ft's checks stay around
  it: a flipped byte in the file it read is refused.
- Its own ``save_checkpoint`` is not called: said once, and the file is lightning-ft's committed one.

The differential scenario ``resume_through_user_checkpoint_io`` (tests/differential) compares the resume with
``DDPStrategy`` at one and two processes.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import CorruptCheckpointError, UnsafeCheckpointError
from lightning_ft.checkpoint.single_file import is_checkpoint_file
from tests.strategy.models import TinyRegressor, make_trainer


class Opaque:
    """A library's class in the hyperparameters (darts keeps its loss and optimizer classes there)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class WithOpaque(TinyRegressor):
    def __init__(self, encoder: Opaque | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_scale = checkpoint["hyper_parameters"]["encoder"].scale

    def on_train_start(self) -> None:
        self.start_weight = self.net[0].weight.detach().clone()


class AllowingCheckpointIO(TorchCheckpointIO):
    """Allows ``Opaque`` for the duration of each load, as darts' plugin allows its classes."""

    def __init__(self) -> None:
        self.loads: list[str] = []

    def load_checkpoint(self, path: Any, map_location: Any = None, **kwargs: Any) -> dict[str, Any]:
        # **kwargs: Lightning 2.6 passes weights_only, which Lightning 2.5's TorchCheckpointIO does not take.
        self.loads.append(str(path))
        with torch.serialization.safe_globals([Opaque]):
            return super().load_checkpoint(path, map_location=map_location, **kwargs)


class WritingItsOwnWay(AllowingCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self.saves: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saves.append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def _train(root, strategy: Any, plugin: Any = None) -> Any:
    ckpt = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    plugins = [plugin] if plugin is not None else []
    trainer = make_trainer(root, strategy=strategy, callbacks=[ckpt], max_steps=2, plugins=plugins)
    trainer.fit(WithOpaque(Opaque(3.0)))
    return root / "checkpoints" / "epoch=0-step=2.ckpt"


def _resume(root, strategy: Any, path, plugin: Any = None) -> WithOpaque:
    model = WithOpaque(Opaque(1.0))
    plugins = [plugin] if plugin is not None else []
    trainer = make_trainer(root / "resume", strategy=strategy, max_steps=3, plugins=plugins)
    trainer.fit(model, ckpt_path=str(path))
    assert trainer.global_step == 3
    return model


@pytest.mark.parametrize("written_by", ["ElasticFT3D", "DDPStrategy"])
def test_the_users_checkpoint_io_reads_the_file_a_resume_loads_as_under_ddp_strategy(tmp_path, written_by):
    writer = ElasticFT3D() if written_by == "ElasticFT3D" else DDPStrategy()
    path = _train(tmp_path, writer, AllowingCheckpointIO())
    saved = torch.load(path, weights_only=False)["state_dict"]["net.0.weight"]
    plugin = AllowingCheckpointIO()
    resumed = _resume(tmp_path, ElasticFT3D(), path, plugin)
    assert plugin.loads == [str(path)]
    assert torch.equal(resumed.start_weight, saved)
    assert resumed.loaded_scale == 3.0
    oracle = AllowingCheckpointIO()
    assert torch.equal(_resume(tmp_path / "ddp", DDPStrategy(), path, oracle).start_weight, saved)
    assert oracle.loads == plugin.loads
    # Without the plugin, lightning-ft's own rule refuses the class, as Lightning's torch.load does.
    with pytest.raises(UnsafeCheckpointError, match="Opaque"):
        _resume(tmp_path / "without", ElasticFT3D(), path)


def test_a_flipped_byte_in_the_file_the_users_checkpoint_io_reads_is_refused(tmp_path):
    path = _train(tmp_path, ElasticFT3D(), AllowingCheckpointIO())
    weight = torch.load(path, weights_only=False)["state_dict"]["net.0.weight"]
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(weight.numpy().tobytes())
    raw[at + 5] ^= 0xFF  # inside the tensor's bytes: torch.load reads it without complaint
    path.write_bytes(bytes(raw))
    plugin = AllowingCheckpointIO()
    with pytest.raises(CorruptCheckpointError, match="CRC32"):
        _resume(tmp_path, ElasticFT3D(), path, plugin)
    assert plugin.loads == [str(path)]  # it read the file; lightning-ft's checksums refused what it returned


def test_a_checkpoint_io_that_writes_its_own_way_is_told_once_that_elastic_ft3d_writes_the_checkpoints(tmp_path):
    plugin = WritingItsOwnWay()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = _train(tmp_path, ElasticFT3D(), plugin)
    said = [str(w.message) for w in caught if "is not called" in str(w.message)]
    assert len(said) == 1 and "WritingItsOwnWay.save_checkpoint is not called" in said[0], said
    assert plugin.saves == []
    assert is_checkpoint_file(path) and torch.load(path, weights_only=False)["global_step"] == 2
    _resume(tmp_path, ElasticFT3D(), path, plugin)
    assert plugin.loads == [str(path)]
