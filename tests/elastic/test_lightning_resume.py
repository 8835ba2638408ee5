"""A real Lightning Trainer resumed mid-epoch from the sampler state sees every sample exactly once per epoch.

A minimal strategy does what ElasticFT3D does with the sampler: swap it in for the training DataLoader's sampler and
mark each batch consumed before it is trained on. The run is "killed" mid-epoch right after a checkpoint and resumed
with ``fit(ckpt_path=...)``; the samples it sees must be exactly those of an uninterrupted run, and the resumed epoch
must end at the same global step.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_ft.elastic import align_batch_progress, find_resumable_sampler, swap_in_resumable_sampler

N, BATCH, EPOCHS = 22, 4, 2  # 6 batches per epoch, the last one short


class IndexDataset(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(i), torch.tensor([float(i)])


class ResumableDataStrategy(SingleDeviceStrategy):
    def process_dataloader(self, dataloader):
        epoch = self.lightning_module.trainer.fit_loop.epoch_progress.current.processed
        return swap_in_resumable_sampler(dataloader, num_replicas=1, rank=0, epoch=epoch)

    def on_train_start(self) -> None:
        align_batch_progress(self.lightning_module.trainer)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        find_resumable_sampler(self.lightning_module.trainer.train_dataloader).mark_consumed(len(batch[0]))


class RecordingModel(L.LightningModule):
    def __init__(self, num_workers: int = 0, batch_size: int = BATCH) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.num_workers = num_workers
        self.batch_size = batch_size
        self.seen: list[tuple[int, int]] = []  # (epoch, sample index)
        self.steps_at_epoch_end: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(), batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        index, x = batch
        self.seen += [(self.current_epoch, i) for i in index.tolist()]
        return self.layer(x).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        self.steps_at_epoch_end.append(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CrashAfter(L.Callback):
    """Save a checkpoint after ``batches`` batches, as ModelCheckpoint(every_n_train_steps) would, then die."""

    def __init__(self, batches: int, path: str) -> None:
        self.batches, self.path = batches, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.batches:
            trainer.save_checkpoint(self.path)
            raise RuntimeError("simulated crash")


def make_trainer(tmp_path, callbacks=(), accumulate_grad_batches: int = 1) -> L.Trainer:
    return L.Trainer(
        accumulate_grad_batches=accumulate_grad_batches,
        strategy=ResumableDataStrategy(device="cpu"),
        max_epochs=EPOCHS,
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def epoch_samples(seen: list[tuple[int, int]], epoch: int) -> list[int]:
    return [i for e, i in seen if e == epoch]


@pytest.mark.parametrize("crash_after", [2, 5, 6, 8])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_trainer_resumed_mid_epoch_sees_every_sample_exactly_once_per_epoch(
    tmp_path, recwarn, crash_after, num_workers
):
    L.seed_everything(0)
    reference = RecordingModel(num_workers)
    make_trainer(tmp_path / "reference").fit(reference)

    L.seed_everything(0)
    crashed = RecordingModel(num_workers)
    ckpt = str(tmp_path / "mid.ckpt")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(tmp_path / "run", [CrashAfter(crash_after, ckpt)]).fit(crashed)

    L.seed_everything(0)
    resumed = RecordingModel(num_workers)
    trainer = make_trainer(tmp_path / "run")
    trainer.fit(resumed, ckpt_path=ckpt)

    seen = crashed.seen + resumed.seen
    for epoch in range(EPOCHS):
        assert sorted(epoch_samples(seen, epoch)) == list(range(N))
        assert epoch_samples(seen, epoch) == epoch_samples(reference.seen, epoch)
    batches_per_epoch = math.ceil(N / BATCH)
    assert reference.steps_at_epoch_end == [batches_per_epoch * (e + 1) for e in range(EPOCHS)]
    # Every epoch the resumed run finishes ends at the step it ends at without the crash. (Saved on the last batch of
    # an epoch, Lightning counts that epoch as finished and does not run its epoch-end hooks again.)
    assert resumed.steps_at_epoch_end == reference.steps_at_epoch_end[-len(resumed.steps_at_epoch_end) :]
    assert len(resumed.steps_at_epoch_end) == EPOCHS - crash_after // batches_per_epoch
    assert trainer.global_step == EPOCHS * batches_per_epoch
    assert not [w for w in recwarn if "not resumable" in str(w.message)]


@pytest.mark.parametrize(("crash_after", "new_batch", "accumulate"), [(2, 2, 2), (3, 2, 2), (1, 1, 4)])
def test_a_trainer_resumed_with_smaller_batches_and_more_accumulation_keeps_every_sample_and_step(
    tmp_path, crash_after, new_batch, accumulate
):
    """The same arithmetic as a resume on more data-parallel ranks with ElasticPolicy(batch="keep_global"): the batch
    counter Lightning restores is in the old batches, and align_batch_progress converts it."""
    L.seed_everything(0)
    reference = RecordingModel()
    make_trainer(tmp_path / "reference").fit(reference)

    L.seed_everything(0)
    crashed = RecordingModel()
    ckpt = str(tmp_path / "mid.ckpt")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(tmp_path / "run", [CrashAfter(crash_after, ckpt)]).fit(crashed)

    resumed = RecordingModel(batch_size=new_batch)
    trainer = make_trainer(tmp_path / "run", accumulate_grad_batches=accumulate)
    trainer.fit(resumed, ckpt_path=ckpt)

    seen = crashed.seen + resumed.seen
    for epoch in range(EPOCHS):
        assert epoch_samples(seen, epoch) == epoch_samples(reference.seen, epoch)
    assert resumed.steps_at_epoch_end == reference.steps_at_epoch_end
