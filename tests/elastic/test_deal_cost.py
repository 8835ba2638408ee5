"""A deal of the replica mode costs milliseconds, not a Python loop over the epoch: a lost group costs the survivors two
deals (the discarded step's, the new membership's), each an iterator restart and an event, on the training thread.

The tensor versions say exactly what the references say: :func:`deal_changes` what :func:`group_remainder` says the
deal repeats and skips, and :class:`ResumableSampler`'s iterator and ``remaining()`` what its ``_remaining_stream``
(the list of the whole rest) gives this replica."""

from __future__ import annotations

import random
import time

import pytest
import torch

from lightning_ft.elastic import ResumableSampler
from lightning_ft.elastic.data_rng import SeededIndex, sample_seed
from lightning_ft.elastic.internal import ReplicaMembership, deal_changes, group_remainder


def _order(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_deal_changes_say_what_group_remainder_says_for_every_membership_count_and_epoch_end():
    rng = random.Random(5)
    cases = 0
    for _ in range(400):
        n = rng.choice([0, 1, 2, 3, 7, 10, 31, 64, 97])
        live = rng.randint(1, 4)
        membership = ReplicaMembership(
            live_groups=live,
            group_index=rng.randrange(live),
            group_size=rng.choice([1, 2, 3]),
            device_batch=rng.choice([1, 2, 3, 5]),
            accumulate=rng.choice([1, 2]),
        )
        committed = rng.choice([0, rng.randint(0, max(n, 1)), n, n + 3])
        flags = {"drop_last": rng.random() < 0.3, "drop_last_batch": rng.random() < 0.3}
        order = _order(n, rng.randrange(100))
        expected = group_remainder(order, committed, membership, **flags)
        assert deal_changes(order, committed, membership, **flags) == (expected.repeated, expected.skipped), (
            n,
            committed,
            membership,
            flags,
        )
        cases += bool(expected.repeated or expected.skipped)
    assert cases > 50  # the epoch's end is covered, not only deals that change nothing


def test_deal_changes_refuse_what_group_remainder_refuses():
    membership = ReplicaMembership(live_groups=1, group_index=0, device_batch=1)
    with pytest.raises(ValueError, match=r"must be a permutation of range\(3\)"):
        deal_changes([0, 0, 1], 0, membership)
    with pytest.raises(ValueError, match=r"must be a permutation of range\(3\)"):
        deal_changes([0, 1, 3], 0, membership)
    with pytest.raises(ValueError, match=r"committed=-1: must be an int >= 0"):
        deal_changes([0, 1, 2], -1, membership)


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def test_a_deal_of_a_large_epoch_is_not_a_python_loop_over_it():
    # Against the reference under the same load (not a fixed bound): a fifth of its time at most; ~20x measured.
    order = torch.randperm(300_000, generator=torch.Generator().manual_seed(0))
    as_list = order.tolist()
    membership = ReplicaMembership(live_groups=2, group_index=1, device_batch=8)
    fast = _seconds(lambda: deal_changes(order, 24_000, membership))
    reference = _seconds(lambda: group_remainder(as_list, 24_000, membership))
    assert fast < reference / 5, (fast, reference)
    assert deal_changes(order, 24_000, membership) == ((), ())


def test_deal_changes_read_the_samplers_own_order_tensor():
    sampler = ResumableSampler(50, num_replicas=3, rank=0, seed=4, batch_size=4, drop_last_batch=True)
    membership = ReplicaMembership(live_groups=3, group_index=0, device_batch=4)
    assert sampler._order_tensor().tolist() == sampler._global_order()
    expected = group_remainder(sampler._global_order(), 12, membership, drop_last_batch=True)
    assert deal_changes(sampler._order_tensor(), 12, membership, drop_last_batch=True) == (
        expected.repeated,
        expected.skipped,
    )


def _reference(sampler: ResumableSampler) -> list:
    """What the iterator yielded when it sliced the list of the whole rest."""
    mine = sampler._remaining_stream(0 if sampler._new_pass else None)[sampler.rank :: sampler.num_replicas]
    if not sampler.per_sample_seeds:
        return [index for index, _ in mine]
    return [SeededIndex(index, sample_seed(sampler.seed, sampler.epoch, pos)) for index, pos in mine]


def test_the_iterator_and_remaining_give_what_the_whole_rest_gives_this_replica():
    rng = random.Random(11)
    uneven = 0
    for _ in range(500):
        n = rng.choice([0, 1, 2, 5, 13, 40, 101])
        replicas = rng.randint(1, 5)
        sampler = ResumableSampler(
            n,
            num_replicas=replicas,
            rank=rng.randrange(replicas),
            shuffle=rng.random() < 0.8,
            seed=rng.randrange(50),
            drop_last=rng.random() < 0.3,
            batch_size=rng.choice([None, 1, 2, 3, 4]),
            drop_last_batch=rng.random() < 0.4,
            per_sample_seeds=rng.random() < 0.3,
        )
        sampler.epoch = rng.randrange(3)
        sampler.consumed = rng.choice([0, rng.randint(0, n + 4), n])
        sampler._new_pass = rng.random() < 0.1
        # A resume at another world: the rest need not fill whole batches on every replica (it is completed).
        if rng.random() < 0.5:
            sampler.num_replicas = rng.randint(1, 5)
            sampler.rank = rng.randrange(sampler.num_replicas)
        expected, rest = _reference(sampler), sampler._remaining_stream()
        assert sampler.remaining() == len(rest) // sampler.num_replicas
        got = list(sampler)  # issuing everything starts a new pass: the references are taken before
        assert got == expected
        assert [type(i) for i in got] == [type(i) for i in expected]
        uneven += len(rest) > max(0, sampler.epoch_end - sampler.consumed)
    assert uneven > 20  # the completed rests are covered


def test_an_iterator_over_a_large_epoch_is_not_a_python_loop_over_it():
    sampler = ResumableSampler(300_000, num_replicas=3, rank=1, seed=0, batch_size=8)
    sampler.consumed = 24_000
    fast = _seconds(lambda: (next(iter(sampler)), sampler.remaining()))
    reference = _seconds(lambda: (_reference(sampler), len(sampler._remaining_stream())))
    assert fast < reference / 3, (fast, reference)  # ~8x measured (the iterator's own list of this replica's share)
    assert next(iter(sampler)) == sampler._global_order()[24_001]
    assert sampler.remaining() == (300_000 - 24_000) // 3
