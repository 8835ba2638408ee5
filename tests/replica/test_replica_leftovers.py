"""The clean-up of uncommitted leftovers at train start, when the fit is a replica group: the groups share the
checkpoint folder, and in a whole-job restart with ``min_replicas=1`` a faster group may already train and have a
save in flight there when a slower one reaches its train start. Only what was last modified before this process
started (a leftover of the failure: every writer of the previous attempt was dead by then) is removed."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lightning_ft.checkpoint import cleanup_uncommitted
from lightning_ft.checkpoint.in_progress import IN_PROGRESS_RECORD
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")


def _uncommitted(folder: Path, step: int, *, mtime: float | None = None) -> Path:
    """A save of ours that has not committed: its folder, its in-progress record and a part written."""
    folder.mkdir(parents=True)
    (folder / IN_PROGRESS_RECORD).write_text(f'{{"step": {step}}}')
    (folder / "part").write_bytes(b"\0" * 64)
    if mtime is not None:
        for path in (folder / "part", folder / IN_PROGRESS_RECORD, folder):
            os.utime(path, (mtime, mtime))
    return folder


def test_older_than_removes_the_leftover_and_keeps_a_folder_written_since(tmp_path: Path) -> None:
    started = time.time()
    leftover = _uncommitted(tmp_path / "epoch=0-step=20.ckpt", 20, mtime=started - 60)
    in_flight = _uncommitted(tmp_path / "epoch=0-step=25.ckpt", 25)  # another process writes it now
    assert cleanup_uncommitted(tmp_path, older_than=started) == [leftover]
    assert in_flight.is_dir() and not leftover.exists()
    # A part written since into an older folder: still being written, kept.
    older = _uncommitted(tmp_path / "epoch=0-step=30.ckpt", 30, mtime=started - 60)
    (older / "part2").write_bytes(b"\1")
    assert cleanup_uncommitted(tmp_path, older_than=started) == []
    assert cleanup_uncommitted(tmp_path) == [in_flight, older]  # without the rule (one job, one writer): both


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_replica_group_s_train_start_never_removes_a_save_another_group_has_in_flight(tmp_path: Path) -> None:
    """A fit as replica group 0 starts; before its train start, another group (of the same job, started earlier)
    begins a save in the shared folder. The leftover of the failure goes; the other group's save stays."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import ElasticFT3D, ReplicaGroups

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)

    ckpt = tmp_path / "ckpt"
    leftover = _uncommitted(ckpt / "epoch=0-step=20.ckpt", 20, mtime=time.time() - 60)
    env = dict(os.environ)
    try:
        with lighthouse() as address:
            groups = ReplicaGroups(
                lighthouse=address, replica_id="0", num_groups=1, address="127.0.0.1", timeout=timedelta(seconds=5)
            )
            strategy = ElasticFT3D(replica_groups=groups)  # this process's attempt starts

            class OtherGroupSaves(L.Callback):
                def setup(self, trainer, pl_module, stage) -> None:  # before this group's train start
                    time.sleep(0.05)  # a coarse clock: the other group's write comes strictly later
                    self.folder = _uncommitted(ckpt / "epoch=0-step=25.ckpt", 25)

            other = OtherGroupSaves()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                strategy=strategy,
                max_steps=2,
                default_root_dir=tmp_path,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[ModelCheckpoint(dirpath=ckpt, every_n_train_steps=100), other],
            )
            trainer.fit(Tiny())
    finally:  # in a pytest process, the group's data-parallel process group (as DDPStrategy's) stays up after fit
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            if key not in env:
                os.environ.pop(key, None)
    assert trainer.global_step == 2
    assert not leftover.exists(), "the leftover of the failure was not removed"
    assert other.folder.is_dir(), "train start removed a save another replica group had in flight"
