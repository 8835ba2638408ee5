"""A one-process run with DTensor parameters (FSDP2 on a mesh of one) writes Lightning's file under ``"auto"``, as a
run of plain state does: its shards are whole tensors. The resume from it is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ft import ElasticFT3D
from lightning_ft._compat import DTensor
from tests.strategy.models import make_trainer
from tests.strategy.test_checkpoint_errors import ShardedRegressor


def _fit(root, max_steps):
    seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(root, strategy=ElasticFT3D(), callbacks=[ckpt], max_steps=max_steps)
    model = ShardedRegressor()
    trainer.fit(model)
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if dist.is_initialized():
        dist.destroy_process_group()
    return trainer, weights


def test_fsdp2_state_on_one_process_is_lightnings_file_and_resumes_exactly(tmp_path):
    _, straight = _fit(tmp_path / "straight", 6)
    _fit(tmp_path / "resumed", 4)
    saved = tmp_path / "resumed" / "ckpt" / "epoch=0-step=4.ckpt"
    assert saved.is_file()
    state_dict = torch.load(saved, weights_only=True)["state_dict"]
    assert all(type(v) is torch.Tensor for v in state_dict.values()) and "net.0.weight" in state_dict
    trainer, resumed = _fit(tmp_path / "resumed", 6)
    assert trainer.global_step == 6
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name


def test_pipeline_stages_keep_folders_and_the_reason_names_the_pipeline_size():
    from types import SimpleNamespace

    from lightning_ft.strategy.parallel_modes import DataParallelMode, PipelineMode

    strategy = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    reason = PipelineMode(strategy).file_refusal()
    assert reason is not None and reason.startswith("pipeline_parallel_size=2: each rank holds one pipeline stage")
    assert DataParallelMode(strategy).file_refusal() is None
