"""Every resize, exhaustively: ResumableSampler under Lightning's epoch arithmetic for every combination of dataset
size, per-device batch (before and after), DataLoader ``drop_last``, sampler ``drop_last``, old and new world size and
save point.

The model of Lightning (2.6, see docs/elastic.md) is exact for what matters here: an epoch has ``len(dataloader)``
batches per rank; a checkpoint taken on the last of them resumes with the next epoch; a mid-epoch resume restores the
batch counter (``align_batch_progress`` sets it to ``completed_batches``) and fetches until the counter reaches the
full length, or until the iterator runs out.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from torch.utils.data import BatchSampler

from lightning_ft.elastic import ResumableSampler

SIZES = range(1, 17)
WORLDS = (1, 2, 3, 4)
BATCHES = (1, 2, 3)


def samplers(n: int, world: int, batch: int, drop_last_batch: bool, drop_last: bool) -> list[ResumableSampler]:
    return [
        ResumableSampler(
            n,
            num_replicas=world,
            rank=rank,
            shuffle=False,
            drop_last=drop_last,
            batch_size=batch,
            drop_last_batch=drop_last_batch,
        )
        for rank in range(world)
    ]


def epoch_batches(sampler: ResumableSampler, batch: int, drop_last_batch: bool) -> list[list[int]]:
    return [[int(i) for i in b] for b in BatchSampler(sampler, batch, drop_last_batch)]


def check_resize(n, before, after, batch, new_batch, drop_last_batch, drop_last) -> None:
    old = samplers(n, before, batch, drop_last_batch, drop_last)
    full_old = len(BatchSampler(old[0], batch, drop_last_batch))
    old_batches = [epoch_batches(s, batch, drop_last_batch) for s in old]
    assert {len(b) for b in old_batches} == {full_old}
    if full_old == 0:
        return  # Lightning does not train an epoch without batches
    for k in range(full_old + 1):
        # Train k batches on every old replica, then save.
        for s in old:
            s.load_state_dict({**s.state_dict(), "epoch": 0, "consumed": 0})
            for _ in range(k):
                s.mark_consumed(batch * before)
        state = old[0].state_dict()
        assert all(s.state_dict() == state for s in old)
        trained = [i for rank in old_batches for b in rank[:k] for i in b]
        consumed = k * batch * before

        new = samplers(n, after, new_batch, drop_last_batch, drop_last)
        for s in new:
            s.load_state_dict(state)
        case = f"n={n} {before}x{batch} -> {after}x{new_batch} drop_last_batch={drop_last_batch} drop_last={drop_last} k={k}"
        if k == full_old:
            # Saved on the last batch: Lightning resumes with the next epoch, and so does the sampler.
            assert all(s.state_dict()["epoch"] == 1 and s.state_dict()["consumed"] == 0 for s in new), case
            continue
        full_new = len(BatchSampler(new[0], new_batch, drop_last_batch))
        completed = new[0].completed_batches(new_batch, drop_last=drop_last_batch)
        assert 0 <= completed <= full_new, case
        rest = []
        for s in new:
            s.set_epoch(0)  # Lightning sets the epoch it resumes before iterating
            rest.append(epoch_batches(s, new_batch, drop_last_batch))
        # Every replica yields exactly the batches Lightning fetches before it ends the epoch: no collective hangs,
        # nothing is left unfetched, and the epoch ends where the counter says.
        assert {len(r) for r in rest} == {full_new - completed}, case
        if drop_last_batch:
            assert all(len(b) == new_batch for r in rest for b in r), case
        after_resume = [i for r in rest for b in r for i in b]
        seen = Counter(trained + after_resume)
        end_new = new[0].epoch_end
        expected = set(range(max(consumed, min(n, end_new))))
        assert set(seen) == expected, case
        unit = after * (new_batch if drop_last_batch else 1)
        repeats = sum(seen.values()) - len(seen)
        assert repeats <= (after - 1) + (unit - 1), case
        if not drop_last_batch and not drop_last:
            assert set(seen) == set(range(n)), case
        # After the resumed epoch's batches the epoch is over for every world.
        for s in new:
            for _ in rest[0]:
                s.mark_consumed(new_batch * after)
        if rest[0]:
            assert all(s.exhausted for s in new), case


@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "sampler_drop_last"])
@pytest.mark.parametrize("drop_last_batch", [False, True], ids=["keep_partial", "drop_partial"])
def test_every_resize_at_every_save_point_trains_the_rest_of_the_epoch_once_and_ends_it_where_lightning_does(
    drop_last_batch, drop_last
):
    for n, before, after, batch, new_batch in itertools.product(SIZES, WORLDS, WORLDS, BATCHES, BATCHES):
        check_resize(n, before, after, batch, new_batch, drop_last_batch, drop_last)


def test_a_resize_with_drop_last_completes_the_last_global_batch_instead_of_dropping_it():
    """26 samples, batch 4, one rank, resumed on two after one step: the rest (22 samples, up to the new world's epoch
    end at 24) is trained in whole global batches of 8, the last one completed with 4 repeats."""
    old = ResumableSampler(26, num_replicas=1, rank=0, shuffle=False, batch_size=4, drop_last_batch=True)
    old.mark_consumed(4)
    new = samplers(26, 2, 4, True, False)
    for s in new:
        s.load_state_dict(old.state_dict())
    rest = [epoch_batches(s, 4, True) for s in new]
    trained = list(range(4)) + [i for r in rest for b in r for i in b]
    assert set(trained) == set(range(24))  # what an uninterrupted run on either world trains
    assert len(trained) == 4 + 3 * 8
    assert new[0].completed_batches() == 0


@pytest.mark.parametrize("drop_last_batch", [False, True])
def test_an_epoch_that_the_new_world_ends_earlier_is_not_rolled_into_the_next_epoch(drop_last_batch):
    """Sampler drop_last with 22 samples: 2 ranks stream all 22, 4 ranks only 20. Saved mid-epoch by 2 ranks after one
    batch of 10 each and resumed on 4, the epoch is over for the new world only: it ends (every batch counts as done),
    rather than starting the next epoch's data under the current epoch's number."""
    old = ResumableSampler(22, num_replicas=2, rank=0, shuffle=False, drop_last=True)
    old.mark_consumed(20)
    assert not old.exhausted
    new = ResumableSampler(22, num_replicas=4, rank=0, shuffle=False, drop_last=True, batch_size=1)
    new.load_state_dict(old.state_dict())
    assert new.state_dict()["epoch"] == 0
    new.set_epoch(0)
    assert list(new) == []
    assert new.completed_batches(1, drop_last=drop_last_batch) == len(new)
