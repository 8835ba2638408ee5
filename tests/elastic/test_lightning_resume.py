"""A real Lightning Trainer resumed mid-epoch from the sampler state sees every sample exactly once per epoch.

A minimal strategy does what ElasticFT3D does with the sampler: swap it in for the training DataLoader's sampler and
mark each batch consumed before it is trained on. The run is "killed" mid-epoch right after a checkpoint and resumed
with ``fit(ckpt_path=...)``; the samples it sees must be exactly those of an uninterrupted run, and the resumed epoch
must end at the same global step.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_ft.elastic import ResumableSampler
from lightning_ft.elastic.internal import align_batch_progress, find_resumable_sampler, swap_in_resumable_sampler

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


def test_a_trainer_resumed_mid_epoch_with_another_seed_finishes_that_epoch_in_its_order_then_follows_the_new_seed(
    tmp_path, caplog
):
    """Saved at seed 0 after 2 batches of epoch 0, resumed after ``seed_everything(2)``: epoch 0 is the seed-0 run's
    (every sample once), epoch 1 the seed-2 run's, as DDPStrategy's sampler built with seed 2 deals it."""
    L.seed_everything(0)
    reference = RecordingModel()
    make_trainer(tmp_path / "reference").fit(reference)
    L.seed_everything(2)
    other_seed = RecordingModel()
    make_trainer(tmp_path / "other").fit(other_seed)

    L.seed_everything(0)
    crashed = RecordingModel()
    ckpt = str(tmp_path / "mid.ckpt")
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(tmp_path / "run", [CrashAfter(2, ckpt)]).fit(crashed)
    L.seed_everything(2)
    resumed = RecordingModel()
    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path / "run").fit(resumed, ckpt_path=ckpt)

    seen = crashed.seen + resumed.seen
    assert epoch_samples(seen, 0) == epoch_samples(reference.seen, 0)
    assert epoch_samples(seen, 1) == epoch_samples(other_seed.seen, 1) != epoch_samples(reference.seen, 1)
    said = [r.getMessage() for r in caplog.records if "this run has seed=2" in r.getMessage()]
    assert said == [
        "lightning-ft: the checkpoint was taken with seed=0, this run has seed=2: the rest of epoch 0 keeps the"
        " checkpoint's data order (seed=0, each sample once), and from epoch 1 on it follows seed=2, as DDPStrategy's"
        " sampler does"
    ]


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


class ReplicaStrategy(ResumableDataStrategy):
    """One data-parallel replica of ``world``, run alone: the sampler deals for ``world`` replicas and counts their
    global batch. Training is per replica (no collectives), so running each replica's Trainer in turn is the run."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__(device="cpu")
        self.world, self.replica = world, rank

    def process_dataloader(self, dataloader):
        epoch = self.lightning_module.trainer.fit_loop.epoch_progress.current.processed
        return swap_in_resumable_sampler(dataloader, num_replicas=self.world, rank=self.replica, epoch=epoch)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        find_resumable_sampler(self.lightning_module.trainer.train_dataloader).mark_consumed(len(batch[0]) * self.world)


class DropLastModel(RecordingModel):
    def __init__(self, n: int, batch_size: int, *, drop_last: bool, sampler_drop_last: bool = False) -> None:
        super().__init__(batch_size=batch_size)
        self.n, self.drop_last, self.sampler_drop_last = n, drop_last, sampler_drop_last

    def train_dataloader(self) -> DataLoader:
        dataset = SizedIndexDataset(self.n)
        if self.sampler_drop_last:
            # What Lightning injects, with drop_last: a DistributedSampler (its replicas are overridden by the swap).
            sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, drop_last=True, seed=0)
            return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=self.drop_last)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=self.drop_last)


class SizedIndexDataset(IndexDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def run_world(tmp_path, world, batch, *, n, drop_last, sampler_drop_last, ckpt=None, crash_after=None, epochs=EPOCHS):
    models, trainers = [], []
    for rank in range(world):
        L.seed_everything(0)
        model = DropLastModel(n, batch, drop_last=drop_last, sampler_drop_last=sampler_drop_last)
        callbacks = [CrashAfter(crash_after, str(tmp_path / f"rank{rank}.ckpt"))] if crash_after else []
        trainer = L.Trainer(
            strategy=ReplicaStrategy(world, rank),
            max_epochs=epochs,
            callbacks=callbacks,
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if crash_after:
            with pytest.raises(RuntimeError, match="simulated crash"):
                trainer.fit(model)
        else:
            trainer.fit(model, ckpt_path=ckpt)
        models.append(model)
        trainers.append(trainer)
    return models, trainers


@pytest.mark.parametrize(
    ("n", "before", "after", "batch", "crash_after", "drop_last", "sampler_drop_last"),
    [
        (26, 1, 2, 4, 1, True, False),  # the rest completes its last global batch instead of dropping it
        (26, 2, 3, 2, 2, True, False),
        (22, 2, 4, 10, 1, False, True),  # nothing left for the new world: the epoch ends, no extra epoch
        (22, 2, 4, 5, 2, True, True),
        (23, 3, 2, 3, 1, False, False),
    ],
)
def test_resized_replicas_under_real_lightning_end_every_epoch_together_and_never_train_one_twice(
    tmp_path, n, before, after, batch, crash_after, drop_last, sampler_drop_last
):
    kwargs = {"n": n, "drop_last": drop_last, "sampler_drop_last": sampler_drop_last}
    crashed, _ = run_world(tmp_path / "run", before, batch, crash_after=crash_after, **kwargs)
    resumed, trainers = run_world(tmp_path / "run", after, batch, ckpt=str(tmp_path / "run" / "rank0.ckpt"), **kwargs)
    # Every new replica ends each epoch at the same step, and the run ends after EPOCHS epochs, none repeated.
    assert len({tuple(m.steps_at_epoch_end) for m in resumed}) == 1
    assert len({t.global_step for t in trainers}) == 1
    assert {t.current_epoch for t in trainers} == {EPOCHS}
    first_epoch = Counter(i for m in crashed + resumed for e, i in m.seen if e == 0)
    consumed = crash_after * batch * before
    fresh_world_epoch = Counter(i for m in resumed for e, i in m.seen if e == 1)
    # The resumed epoch trains what the old world trained plus the rest up to the new world's end of epoch.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    new_world = ResumableSampler(
        n, num_replicas=after, rank=0, drop_last=sampler_drop_last, batch_size=batch, drop_last_batch=drop_last
    )
    assert set(first_epoch) == set(order[: max(consumed, min(n, new_world.epoch_end))])
    assert sum(first_epoch.values()) - len(first_epoch) < after * batch
    # The next epoch is a plain epoch on the new world: each sample at most once (DistributedSampler's padding aside).
    assert sum(fresh_world_epoch.values()) - len(fresh_world_epoch) < after
