"""swap_in_resumable_sampler: Lightning's injected sampler is replaced without changing what training sees."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from lightning_ft.elastic import ResumableSampler
from lightning_ft.elastic.internal import find_resumable_sampler, swap_in_resumable_sampler


class RangeDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class MyLoader(DataLoader):
    """A user's DataLoader subclass with an argument of its own."""

    def __init__(self, dataset, *, tag: str, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


class EveryOther(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


def batches(loader) -> list[list[int]]:
    return [b.tolist() for b in loader]


def lightning_injected(loader: DataLoader, *, num_replicas: int, rank: int) -> DataLoader:
    """What Lightning's data connector does with use_distributed_sampler=True in a distributed run."""
    sampler = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0, num_replicas=num_replicas, rank=rank)
    return _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_swapping_lightnings_distributed_sampler_keeps_every_batch(monkeypatch, shuffle, drop_last):
    monkeypatch.setenv("PL_GLOBAL_SEED", "1234")  # what seed_everything sets; Lightning seeds its sampler from it
    for rank in range(3):
        user = DataLoader(RangeDataset(29), batch_size=4, shuffle=shuffle, drop_last=drop_last)
        injected = lightning_injected(user, num_replicas=3, rank=rank)
        swapped = swap_in_resumable_sampler(injected, num_replicas=3, rank=rank)
        assert isinstance(swapped.sampler, ResumableSampler)
        assert swapped.sampler.seed == 1234
        for epoch in (0, 1):
            injected.sampler.set_epoch(epoch)
            swapped.sampler.set_epoch(epoch)
            assert batches(swapped) == batches(injected)
            assert len(swapped) == len(injected)


def test_the_rebuilt_loader_keeps_the_users_class_and_settings():
    def collate(items):
        return torch.stack(items) * 10

    user = MyLoader(RangeDataset(10), tag="mine", batch_size=3, shuffle=False, collate_fn=collate, drop_last=True)
    swapped = swap_in_resumable_sampler(user, num_replicas=1, rank=0)
    assert type(swapped) is MyLoader and swapped.tag == "mine"
    assert (swapped.batch_size, swapped.drop_last, swapped.collate_fn) == (3, True, collate)
    assert batches(swapped) == [[0, 10, 20], [30, 40, 50], [60, 70, 80]]


def test_a_plain_random_sampler_becomes_a_shuffled_resumable_one_seeded_like_lightning(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    swapped = swap_in_resumable_sampler(
        DataLoader(RangeDataset(12), batch_size=5, shuffle=True), num_replicas=1, rank=0
    )
    sampler = find_resumable_sampler(swapped)
    assert sampler is not None and sampler.shuffle and sampler.seed == 7
    assert sorted(sum(batches(swapped), [])) == list(range(12))


def test_the_swapped_loader_is_stateful_to_lightning_and_resumes_mid_epoch():
    loader = swap_in_resumable_sampler(DataLoader(RangeDataset(12), batch_size=3, shuffle=True), num_replicas=1, rank=0)
    assert isinstance(loader, _Stateful)
    full = batches(loader)
    find_resumable_sampler(loader).mark_consumed(3)
    state = loader.state_dict()

    fresh = swap_in_resumable_sampler(DataLoader(RangeDataset(12), batch_size=3, shuffle=True), num_replicas=1, rank=0)
    fresh.load_state_dict(state)
    assert batches(fresh) == full[1:]


def test_a_resumable_sampler_for_another_world_is_rebuilt_with_its_state():
    loader = swap_in_resumable_sampler(DataLoader(RangeDataset(12), batch_size=2), num_replicas=2, rank=0)
    find_resumable_sampler(loader).mark_consumed(4)
    again = swap_in_resumable_sampler(loader, num_replicas=4, rank=3)
    sampler = find_resumable_sampler(again)
    assert (sampler.num_replicas, sampler.rank, sampler.consumed) == (4, 3, 4)
    assert swap_in_resumable_sampler(again, num_replicas=4, rank=3) is again


def test_custom_samplers_and_iterable_datasets_are_left_alone_with_one_message(caplog):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    custom = DataLoader(RangeDataset(10), sampler=EveryOther(10), batch_size=2)
    streaming = DataLoader(Stream(), batch_size=2)
    with caplog.at_level(logging.INFO):
        assert swap_in_resumable_sampler(custom, num_replicas=1, rank=0) is custom
        assert swap_in_resumable_sampler(custom, num_replicas=1, rank=0) is custom
        assert swap_in_resumable_sampler(streaming, num_replicas=1, rank=0) is streaming
    assert find_resumable_sampler(custom) is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("custom sampler (EveryOther)" in m for m in messages) == 1
    assert not isinstance(custom, _Stateful)
