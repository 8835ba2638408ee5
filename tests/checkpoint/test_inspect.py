"""``describe`` reports what a checkpoint holds; ``export_state_dict`` writes one plain file Lightning and torch load."""

from __future__ import annotations

import argparse

import lightning
import pytest
import torch
import torch.nn as nn

from lightning_ft.checkpoint import AsyncCheckpointer
from lightning_ft.checkpoint.internal import COMMIT_MARKER, describe, export_state_dict, format_description
from tests.checkpoint.support import folders_only

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


class TinyModule(lightning.LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(3, hidden)


def save_lightning_like(path, module: TinyModule, step: int) -> None:
    state = {
        "state_dict": module.state_dict(),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "hyper_parameters": dict(module.hparams),
        "epoch": 2,
        "global_step": step,
        "pytorch-lightning_version": lightning.__version__,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 2}}}},
        "cli_args": argparse.Namespace(seed=1),
    }
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(path, state, metadata={"step": step, "epoch": 2, "mesh_shape": {"data_parallel": 1}})
    finally:
        checkpointer.close()


def test_describe_reports_step_world_size_bytes_commit_and_checksums(tmp_path):
    folders_only()
    save_lightning_like(tmp_path / "step=10", TinyModule(), 10)
    desc = describe(tmp_path / "step=10")
    assert desc["committed"] and desc["checksums_ok"] and desc["problems"] == []
    assert desc["step"] == 10 and desc["epoch"] == 2 and desc["world_size"] == 1
    assert desc["format_version"] == 1 and desc["tensors"] == 3
    assert desc["size_bytes"] == (3 * 4 + 4 + 1) * 4
    assert desc["mesh"] == {"data_parallel": 1}
    text = format_description(desc)
    assert "committed       yes" in text and "checksums       ok" in text and "step            10" in text

    (tmp_path / "step=10" / COMMIT_MARKER).unlink()
    desc = describe(tmp_path / "step=10")
    assert not desc["committed"] and "committed       NO" in format_description(desc)


def test_export_gives_a_file_that_torch_loads_with_weights_only_and_lightning_loads_as_a_module(tmp_path):
    torch.manual_seed(0)
    module = TinyModule(hidden=5, lr=0.25)
    save_lightning_like(tmp_path / "step=7", module, 7)
    out = export_state_dict(tmp_path / "step=7", tmp_path / "model.ckpt")

    plain = torch.load(out, weights_only=True)
    assert plain["global_step"] == 7 and plain["epoch"] == 2
    assert plain["hyper_parameters"] == {"hidden": 5, "lr": 0.25}
    assert plain["state_dict"].keys() == module.state_dict().keys()
    for key, value in module.state_dict().items():
        assert torch.equal(plain["state_dict"][key], value)

    restored = TinyModule.load_from_checkpoint(out)
    assert restored.hparams.hidden == 5 and restored.hparams.lr == 0.25
    assert torch.equal(restored.layer.weight, module.layer.weight)
