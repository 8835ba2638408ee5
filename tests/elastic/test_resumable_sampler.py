"""ResumableSampler: DistributedSampler's order, a world-size-independent state, and resumes at any world size."""

from __future__ import annotations

import json
import logging
import math
import pickle
from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from lightning_ft.elastic import ResumableSampler
from lightning_ft.elastic.data_rng import SeededIndex


def replicas(n: int, world: int, **kwargs) -> list[ResumableSampler]:
    return [ResumableSampler(n, num_replicas=world, rank=rank, **kwargs) for rank in range(world)]


def save_after_batches(n: int, world: int, batch: int, k: int, **kwargs) -> tuple[list[int], dict]:
    """Train ``k`` batches of ``batch`` per replica on ``world`` replicas; return the samples seen and the state."""
    samplers = replicas(n, world, **kwargs)
    seen = []
    for sampler in samplers:
        seen += list(sampler)[: k * batch]
    for sampler in samplers:
        for _ in range(k):
            sampler.mark_consumed(batch * world)
    states = [sampler.state_dict() for sampler in samplers]
    assert all(state == states[0] for state in states)
    return seen, states[0]


def resume(n: int, world: int, state: dict, **kwargs) -> list[list[int]]:
    samplers = replicas(n, world, **kwargs)
    for sampler in samplers:
        sampler.load_state_dict(state)
    return [list(sampler) for sampler in samplers]


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("n", [0, 1, 7, 16, 33])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_yields_exactly_what_distributed_sampler_yields(n, world, shuffle, drop_last):
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableSampler(
                _Sized(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            theirs = DistributedSampler(
                _Sized(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_state_is_plain_and_independent_of_world_size():
    states = []
    for world in (1, 2, 4):
        sampler = ResumableSampler(40, num_replicas=world, rank=0, seed=3)
        sampler.set_epoch(2)
        sampler.mark_consumed(8)
        states.append(sampler.state_dict())
    assert states[0] == states[1] == states[2]
    assert json.loads(json.dumps(states[0])) == states[0]
    assert states[0] == {"epoch": 2, "consumed": 8, "seed": 3, "shuffle": True, "drop_last": False, "dataset_len": 40}


@pytest.mark.parametrize("n", [24, 29])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_on_the_same_world_size_continues_exactly_where_the_run_stopped(n, drop_last, world):
    batch = 2
    uninterrupted = [list(s) for s in replicas(n, world, seed=11, drop_last=drop_last)]
    for k in range(math.ceil(len(uninterrupted[0]) / batch)):
        _, state = save_after_batches(n, world, batch, k, seed=11, drop_last=drop_last)
        rest = resume(n, world, state, seed=11, drop_last=drop_last)
        assert rest == [full[k * batch :] for full in uninterrupted]


@pytest.mark.parametrize(("before", "after"), [(2, 2), (4, 3), (1, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_state_saved_on_the_last_batch_resumes_with_the_next_epoch(before, after, drop_last):
    n, batch = 21, 2
    per_replica = n // before if drop_last else math.ceil(n / before)
    _, state = save_after_batches(n, before, batch, math.ceil(per_replica / batch), seed=3, drop_last=drop_last)
    next_epoch = replicas(n, after, seed=3, drop_last=drop_last)
    for sampler in next_epoch:
        sampler.set_epoch(state["epoch"] + 1)
    assert resume(n, after, state, seed=3, drop_last=drop_last) == [list(s) for s in next_epoch]


@pytest.mark.parametrize("n", [23, 24, 48, 61])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1), (1, 4), (2, 2), (4, 3)])
@pytest.mark.parametrize("batch", [1, 3])
def test_resume_on_another_world_size_sees_every_sample_once_up_to_padding(n, before, after, batch):
    """Without drop_last, every index is seen; the extras are padding: at most after - 1 from DistributedSampler's own
    rule (pad the stream to a multiple of the replicas) and at most after - 1 more to even out the rest of the epoch
    across the new replicas. Before the save no index repeats."""
    per_replica = math.ceil(n / before)
    for k in range(math.ceil(per_replica / batch)):
        seen_before, state = save_after_batches(n, before, batch, k, seed=1)
        rest = resume(n, after, state, seed=1)
        counts = Counter(seen_before + sum(rest, []))
        assert set(counts) == set(range(n))
        assert len(seen_before) == len(set(seen_before)) == state["consumed"]
        extras = sum(counts.values()) - n
        assert 0 <= extras <= 2 * (after - 1)
        assert len({len(r) for r in rest}) == 1, "replicas must yield equally many samples or collectives hang"


def test_set_epoch_starts_a_new_epoch_but_keeps_the_offset_of_the_epoch_being_resumed():
    sampler = ResumableSampler(10, num_replicas=1, rank=0)
    sampler.set_epoch(1)
    sampler.mark_consumed(4)
    resumed = ResumableSampler(10, num_replicas=1, rank=0)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(1)  # Lightning calls this again for the epoch it resumes
    assert len(list(resumed)) == 6
    resumed.set_epoch(2)
    assert resumed.state_dict()["consumed"] == 0
    assert sorted(resumed) == list(range(10))


def test_a_new_epoch_shuffles_differently_and_the_same_seed_repeats_it():
    a, b = ResumableSampler(50, num_replicas=1, rank=0, seed=9), ResumableSampler(50, num_replicas=1, rank=0, seed=9)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first


def test_consumed_stops_at_the_end_of_the_epoch_and_a_cycled_loader_starts_a_new_pass():
    sampler = ResumableSampler(10, num_replicas=3, rank=0)  # 12 stream positions with padding
    first_pass = list(sampler)
    for _ in range(2):
        sampler.mark_consumed(3 * 3)  # the second batch is short: the count stops at the end
    assert sampler.state_dict()["consumed"] == 12
    state = sampler.state_dict()
    # CombinedLoader cycles a shorter loader within the epoch: iter() again is a new pass over the same order.
    assert list(sampler) == first_pass
    sampler.mark_consumed(3 * 2)
    assert sampler.state_dict()["consumed"] == 6
    resumed = ResumableSampler(10, num_replicas=3, rank=0)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == first_pass[2:]
    done = ResumableSampler(10, num_replicas=3, rank=0)
    done.load_state_dict(state)  # saved on the pass's last batch: the epoch is over for a loader of its own
    assert done.state_dict()["epoch"] == 1


@pytest.mark.parametrize("drop_last_batch", [False, True])
def test_completed_batches_makes_the_resumed_epoch_end_on_its_last_batch(drop_last_batch):
    n, batch = 50, 4
    _, state = save_after_batches(n, 2, batch, 3, seed=0)
    same = ResumableSampler(n, num_replicas=2, rank=0)
    same.load_state_dict(state)
    assert same.completed_batches(batch, drop_last=drop_last_batch) == 3
    for world in (1, 3, 4):
        sampler = ResumableSampler(n, num_replicas=world, rank=0)
        sampler.load_state_dict(state)
        rest = len(list(sampler))
        full = len(sampler) // batch if drop_last_batch else math.ceil(len(sampler) / batch)
        rest_batches = rest // batch if drop_last_batch else math.ceil(rest / batch)
        assert sampler.completed_batches(batch, drop_last=drop_last_batch) + rest_batches == full


def test_load_state_dict_refuses_a_state_from_another_order():
    sampler = ResumableSampler(10, num_replicas=1, rank=0, seed=1)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="shuffle=False"):
        sampler.load_state_dict({**state, "shuffle": False})
    with pytest.raises(ValueError, match="dataset_len=11"):
        sampler.load_state_dict({**state, "dataset_len": 11})
    with pytest.raises(ValueError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})


def distributed_order(n: int, world: int, seed: int, epoch: int) -> list[list[int]]:
    """What DDPStrategy's sampler, built with ``seed``, yields on each replica in ``epoch``."""
    samplers = [
        DistributedSampler(_Sized(n), num_replicas=world, rank=r, shuffle=True, seed=seed) for r in range(world)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_with_another_seed_finishes_the_epoch_in_the_checkpoints_order_then_follows_the_new_seed(
    world, caplog
):
    """Saved at seed 0 after 3 batches of epoch 1, resumed at seed 2: the rest of epoch 1 is the seed-0 run's rest
    (every sample of the epoch once), and epoch 2 is what DistributedSampler(seed=2) yields, as under DDPStrategy; the
    state taken meanwhile still names the order being finished."""
    n, batch = 40, 4
    saver = replicas(n, world, seed=0)
    for sampler in saver:
        sampler.set_epoch(1)
    seen = [list(sampler)[: 3 * batch] for sampler in saver]
    for sampler in saver:
        for _ in range(3):
            sampler.mark_consumed(batch * world)
    state = saver[0].state_dict()
    uninterrupted = distributed_order(n, world, seed=0, epoch=1)
    resumed = replicas(n, world, seed=2)
    with caplog.at_level(logging.INFO):
        for sampler in resumed:
            sampler.load_state_dict(state)
            sampler.set_epoch(1)  # Lightning calls it for the epoch it resumes in
    assert "the rest of epoch 1 keeps the checkpoint's data order (seed=0, each sample once)" in caplog.text
    assert "from epoch 2 on it follows seed=2" in caplog.text
    rest = [list(sampler) for sampler in resumed]
    assert [a + b for a, b in zip(seen, rest, strict=True)] == uninterrupted
    assert resumed[0].state_dict()["seed"] == 0
    for sampler in resumed:
        sampler.set_epoch(2)
    assert [list(sampler) for sampler in resumed] == distributed_order(n, world, seed=2, epoch=2)
    assert resumed[0].state_dict()["seed"] == 2


def test_a_state_of_another_seed_taken_at_the_end_of_an_epoch_follows_the_new_seed_at_once():
    n, world = 24, 2
    _, state = save_after_batches(n, world, 4, 3, seed=0)  # 3 batches of 4 on 2 replicas: epoch 0 is over
    resumed = replicas(n, world, seed=5)
    for sampler in resumed:
        sampler.load_state_dict(state)
        sampler.set_epoch(1)
    assert [list(sampler) for sampler in resumed] == distributed_order(n, world, seed=5, epoch=1)
    assert "follows seed=5 from epoch 1 on" in resumed[0]._seed_message(0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 0, "rank": 0}, "num_replicas=0"),
        ({"num_replicas": 2, "rank": 2}, "rank=2"),
        ({"num_replicas": 2, "rank": -1}, "rank=-1"),
    ],
)
def test_bad_replica_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResumableSampler(10, **kwargs)


def test_indices_are_plain_ints_unless_per_sample_seeds_are_asked_for():
    plain = ResumableSampler(10, num_replicas=2, rank=1, seed=3)
    assert all(type(i) is int for i in plain)
    seeded = ResumableSampler(10, num_replicas=2, rank=1, seed=3, per_sample_seeds=True)
    assert list(seeded) == list(plain)
    assert all(isinstance(i, SeededIndex) for i in seeded)


def test_the_first_index_hook_runs_once_per_iterator_and_only_when_the_first_index_is_asked_for():
    sampler = ResumableSampler(6, num_replicas=1, rank=0, shuffle=False)
    calls = []
    sampler.before_first_index = lambda: calls.append(len(calls))
    iterator = iter(sampler)
    assert calls == []  # creating the iterator (as DataLoader does, before its fetch) does not call it
    first = next(iterator)
    assert (first, calls) == (0, [0])
    list(iterator)
    assert calls == [0]
    list(sampler)
    assert calls == [0, 1]


def test_a_pickled_sampler_keeps_its_position_and_drops_the_run_s_hook():
    sampler = ResumableSampler(10, num_replicas=1, rank=0, shuffle=False)
    calls = []
    sampler.before_first_index = lambda: calls.append(1)  # a lambda, as a run's hooks are: not picklable
    iterator = iter(sampler)
    assert [next(iterator) for _ in range(3)] == [0, 1, 2] and calls == [1]
    copy = pickle.loads(pickle.dumps(sampler))
    assert copy.before_first_index is None
    assert copy.state_dict() == sampler.state_dict()
