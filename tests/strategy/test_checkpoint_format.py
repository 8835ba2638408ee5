"""ElasticFT3D(checkpoint_format="dcp"): the same checkpoints, committed and resumed, in PyTorch's DCP layout."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_ft import ElasticFT3D
from lightning_ft.checkpoint import list_committed, load_checkpoint
from lightning_ft.checkpoint.internal import is_committed
from lightning_ft.events import read_events
from tests.helpers import as_a_new_process
from tests.strategy.models import TinyRegressor, make_trainer

pytestmark = pytest.mark.usefixtures("event_log_on_disk")  # these runs read their event log


def _fit(tmp_path, max_steps):
    as_a_new_process()  # each call stands for a launch
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = make_trainer(
        tmp_path, strategy=ElasticFT3D(checkpoint_format="dcp"), callbacks=[ckpt], max_steps=max_steps
    )
    model = TinyRegressor()
    trainer.fit(model)
    return trainer, model


def test_dcp_format_checkpoints_commit_resume_and_are_read_by_pytorch_tools(tmp_path):
    _, model = _fit(tmp_path, 4)
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert is_committed(path) and (path / ".metadata").is_file() and not (path / ".snapshot_metadata").exists()
    last = tmp_path / "ckpt" / "last.ckpt"  # a checkpoint of its own, of the same step
    assert not last.is_symlink() and is_committed(last) and (last / ".metadata").is_file()
    loaded = load_checkpoint(path)  # the format is recognized from the folder
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state["state_dict"][name], tensor), name
    dcp_to_torch_save(path, tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt", weights_only=True)
    trainer, _ = _fit(tmp_path, 6)
    assert trainer.global_step == 6
    assert [e["step"] for e in read_events(tmp_path) if e["event"] == "resumed"] == [4]
    listed = [(c.path.name, c.step) for c in list_committed(tmp_path / "ckpt")]
    assert [step for name, step in listed if name != "last.ckpt"] == [2, 4, 6] and ("last.ckpt", 6) in listed


def test_an_unknown_checkpoint_format_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"ElasticFT3D\(checkpoint_format='zarr'\): must be one of 'torchsnapshot'"):
        ElasticFT3D(checkpoint_format="zarr")


def test_the_fault_injectors_storage_faults_wrap_the_chosen_format(tmp_path):
    import errno

    from lightning_ft.fault import FaultInjector

    injector = FaultInjector().storage_error_at(rank=0, step=4, errno="ENOSPC")
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, strategy=ElasticFT3D(checkpoint_format="dcp"), callbacks=[ckpt, injector], max_steps=8
    )
    with pytest.raises(OSError) as raised:
        trainer.fit(TinyRegressor())
    assert raised.value.errno == errno.ENOSPC
    [committed] = list_committed(tmp_path / "ckpt")
    assert committed.step == 2 and (committed.path / ".metadata").is_file()  # written as DCP, not torchsnapshot
