"""What Lightning's own test suite checks of a strategy, held here with ``DDPStrategy`` as the oracle: the same
script under both, the same outcome (docs/lightning-compatibility.md lists what differs by design)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from lightning_ft import ElasticFT3D
from tests.strategy.models import TinyRegressor, make_trainer

STRATEGIES = {"ddp": DDPStrategy, "elastic_ft3d": ElasticFT3D}


class _RecordingIO(TorchCheckpointIO):
    """A user's ``CheckpointIO`` that takes ``storage_options`` (an object store's metadata, say): it records them and
    writes the checkpoint as Lightning's own plugin does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append((str(path), storage_options))
        super().save_checkpoint(checkpoint, path)


def _fitted(tmp_path, strategy, **kwargs):
    trainer = make_trainer(tmp_path, strategy=STRATEGIES[strategy](), max_steps=2, enable_checkpointing=False, **kwargs)
    trainer.fit(TinyRegressor())
    return trainer


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_storage_options_of_a_save_reach_the_users_checkpoint_io(tmp_path, strategy):
    io = _RecordingIO()
    trainer = _fitted(tmp_path, strategy, plugins=[io])
    path = tmp_path / "tagged.ckpt"
    trainer.save_checkpoint(path, storage_options={"tags": {"stage": "after-fit"}})
    assert io.calls == [(str(path), {"tags": {"stage": "after-fit"}})]
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == 2
    weights = trainer.lightning_module.state_dict()
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items())


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_storage_options_with_lightnings_default_checkpoint_io_are_refused_as_lightning_refuses_them(
    tmp_path, strategy
):
    trainer = _fitted(tmp_path, strategy)
    with pytest.raises(TypeError, match=r"storage_options.*not supported for `TorchCheckpointIO`"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"tags": {}})
    assert not (tmp_path / "x.ckpt").exists()
