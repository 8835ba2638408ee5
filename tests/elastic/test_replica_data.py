"""Replica groups come and go, steps are discarded: the committed history still trains every sample of the epoch once.

The harness plays an epoch the way the replica mode does: every rank of every live group has its own
:class:`ResumableSampler`; at a membership change and after a discarded step each is resharded with the committed
count and its iterator restarted; each step takes ``device_batch x accumulate`` samples per rank; a committed step
adds its samples to the history, a discarded one adds nothing. The history must be the epoch once, plus exactly the
repeats and minus exactly the skips that :func:`group_remainder` announced.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from lightning_ft.elastic import ElasticPolicy, ResumableSampler
from lightning_ft.elastic.internal import (
    ReplicaMembership,
    committed_after,
    group_remainder,
    plan_resume,
    reshard_sampler,
)

_SEED = 17


def _order(n: int) -> list[int]:
    """The epoch's order, as every rank's ResumableSampler draws it (epoch 0)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(_SEED)).tolist()


class _Run:
    """One epoch of replica groups under a random schedule of losses, joins and discarded steps."""

    def __init__(self, n: int, rng: random.Random, *, drop_last: bool = False, drop_last_batch: bool = False) -> None:
        self.n, self.rng, self.drop_last, self.drop_last_batch = n, rng, drop_last, drop_last_batch
        self.group_size = rng.choice([1, 2])
        self.device_batch = rng.choice([1, 2, 3])
        self.groups = list(range(rng.randint(1, 4)))  # ids of the live groups, in quorum order
        self.next_id = len(self.groups)
        self.history: list[int] = []
        self.committed = 0
        self.announced = None  # the last GroupRemainder: what the epoch's end repeats and skips
        self.changed_since = False  # whether the deal was made anew after it (a membership change, a discarded step)
        self.samplers: dict[int, list[ResumableSampler]] = {}
        self.steps = {"committed": 0, "discarded": 0, "changes": 0}

    def sampler(self, group: int, local_rank: int) -> ResumableSampler:
        if group not in self.samplers:  # a new group builds its own, as a replacement's process does
            self.samplers[group] = [
                ResumableSampler(
                    self.n,
                    num_replicas=self.group_size,
                    rank=r,
                    seed=_SEED,
                    drop_last=self.drop_last,
                    batch_size=self.device_batch,
                    drop_last_batch=self.drop_last_batch,
                )
                for r in range(self.group_size)
            ]
        return self.samplers[group][local_rank]

    def membership(self, index: int, accumulate: int) -> ReplicaMembership:
        return ReplicaMembership(
            live_groups=len(self.groups),
            group_index=index,
            group_size=self.group_size,
            device_batch=self.device_batch,
            accumulate=accumulate,
        )

    def play(self, deal: Callable[[_Run, int], dict[tuple[int, int], list[int]]] | None = None) -> None:
        accumulate = self.rng.choice([1, 2])
        iterators: dict[tuple[int, int], list[int]] = {}
        stale = True
        for _ in range(10_000):
            if self.rng.random() < 0.25:  # a group is lost, or a new one joins
                if len(self.groups) > 1 and self.rng.random() < 0.5:
                    self.groups.remove(self.rng.choice(self.groups))
                elif len(self.groups) < 5:
                    self.groups.insert(self.rng.randrange(len(self.groups) + 1), self.next_id)
                    self.next_id += 1
                accumulate = self.rng.choice([1, 2, 3])
                self.steps["changes"] += 1
                self.changed_since = True
                stale = True
            if stale:
                iterators = (deal or _deal_from_committed)(self, accumulate)
                stale = False
            taken = {key: it[: self.device_batch * accumulate] for key, it in iterators.items()}
            for key in iterators:
                del iterators[key][: self.device_batch * accumulate]
            if not any(taken.values()):
                return  # the epoch is over
            if self.rng.random() < 0.2:  # the step saw a failure: discarded, its batches go back to the rest
                self.steps["discarded"] += 1
                self.changed_since = stale = True
                continue
            self.steps["committed"] += 1
            self.history += [i for key in sorted(taken) for i in taken[key]]
            self.committed = committed_after(
                self.committed,
                self.membership(0, accumulate),
                dataset_len=self.n,
                drop_last=self.drop_last,
                drop_last_batch=self.drop_last_batch,
            )
        raise AssertionError("the epoch never ended")


def _deal_from_committed(run: _Run, accumulate: int) -> dict[tuple[int, int], list[int]]:
    """The replica mode: every rank's sampler resharded from the committed count."""
    order = _order(run.n)
    iterators = {}
    for index, group in enumerate(run.groups):
        membership = run.membership(index, accumulate)
        expected = group_remainder(
            order, run.committed, membership, drop_last=run.drop_last, drop_last_batch=run.drop_last_batch
        )
        if run.committed < run.n:  # samples of the epoch are left: the forecast of what its end repeats and skips
            run.announced, run.changed_since = expected, False
        for r in range(run.group_size):
            sampler = run.sampler(group, r)
            reshard_sampler(sampler, membership, local_rank=r, committed=run.committed)
            iterators[(group, r)] = list(sampler)
            assert tuple(iterators[(group, r)]) == expected.ranks[r], "the sampler yields what group_remainder says"
    return iterators


def _deal_torchft_shards(run: _Run, accumulate: int) -> dict[tuple[int, int], list[int]]:
    """torchft's DistributedSampler: a fixed shard per group (of at most 5), iterated on through every change: the
    shard of a lost group is never trained, a discarded batch is gone (the iterator moved on)."""
    order, shards = _order(run.n), 5 * run.group_size
    if not hasattr(run, "shards"):
        run.shards = {}
    for group in run.groups:
        for r in range(run.group_size):
            run.shards.setdefault((group, r), order[(group % 5) * run.group_size + r :: shards])
    return {(group, r): run.shards[(group, r)] for group in run.groups for r in range(run.group_size)}


def _assert_each_sample_once(run: _Run) -> None:
    """The history is the epoch once, minus the announced skips, plus the announced repeats: all of them if the deal
    held to the end; if it was made anew after the epoch's last sample was committed (a membership change, a
    discarded step), the epoch ends there, without the rest of them."""
    assert run.announced is not None
    history = Counter(run.history)
    once = Counter(range(run.n))
    once.subtract(Counter(run.announced.skipped))
    assert history & once == +once and not (history & Counter(run.announced.skipped)), (
        f"missing {sorted((once - history).elements())[:20]}"
    )
    repeats, announced = history - once, Counter(run.announced.repeated)
    assert repeats == announced if not run.changed_since else not repeats - announced, (
        f"repeated {sorted(repeats.elements())}, announced {sorted(announced.elements())}"
    )


@pytest.mark.parametrize("case", range(300))
def test_every_sample_is_trained_once_in_the_committed_history_under_losses_joins_and_discarded_steps(case):
    rng = random.Random(case)
    drop_last, drop_last_batch = rng.random() < 0.2, rng.random() < 0.3
    run = _Run(rng.randint(1, 80), rng, drop_last=drop_last, drop_last_batch=drop_last_batch)
    run.play()
    _assert_each_sample_once(run)
    # The exceptions are only at the epoch's end: a few samples, well under two global batches (5 groups x 2 ranks x
    # 3 samples), and no sample is skipped twice.
    assert len(run.announced.repeated) + len(run.announced.skipped) < 2 * 5 * 2 * 3
    assert len(set(run.announced.skipped)) == len(run.announced.skipped)


def test_torchft_fixed_shards_lose_the_dead_groups_samples_and_the_harness_sees_it():
    # The same harness, with torchft's sharding instead of the reshard: a lost group's shard and every discarded batch
    # are missing from the committed history.
    failures = 0
    for case in range(30):
        rng = random.Random(case)
        run = _Run(rng.randint(20, 80), rng)
        run.play(_deal_torchft_shards)
        run.announced = group_remainder(
            _order(run.n), 0, ReplicaMembership(live_groups=1, group_index=0, device_batch=1)
        )
        try:
            _assert_each_sample_once(run)
        except AssertionError:
            failures += 1
    assert failures >= 25


def test_a_scripted_epoch_of_losses_joins_and_a_discarded_step_trains_each_sample_exactly_once():
    # 24 samples, one rank per group, one sample per step and group. 3 groups commit 2 steps (positions 0-5); group
    # "b" dies during the third, which is discarded; "a" and "c" commit 3 steps (positions 6-11, the discarded
    # batch first); "d" joins between them and the 3 commit 4 steps (12-23). No sample is missed or repeated.
    order, committed, history = _order(24), 0, []
    samplers = {g: ResumableSampler(24, num_replicas=1, rank=0, seed=_SEED, batch_size=1) for g in "abcd"}
    for groups, steps in [("abc", 2), ("abc", -1), ("ac", 3), ("adc", 4)]:
        batches = {}
        for index, group in enumerate(groups):
            membership = ReplicaMembership(live_groups=len(groups), group_index=index, device_batch=1)
            reshard_sampler(samplers[group], membership, local_rank=0, committed=committed)
            batches[group] = list(samplers[group])
        if steps < 0:
            assert [batches[g][0] for g in groups] == order[6:9]  # the discarded step's batch
            continue
        for step in range(steps):
            history += [batches[g][step] for g in groups]
            committed = committed_after(committed, membership, dataset_len=24)
        assert committed == len(history)
    assert history == order


@pytest.mark.parametrize("live_groups", [1, 2, 4])
def test_keep_global_keeps_the_samples_per_committed_step(live_groups):
    # ElasticPolicy(batch="keep_global") with 4 groups of 2 ranks at batch 4: plan_resume gives the accumulation for
    # the live groups, and a committed step still trains the same 32 samples.
    decision = plan_resume(
        ElasticPolicy(batch="keep_global"),
        saved_world_size=8,
        saved_dp_size=8,
        saved_per_device_batch=4,
        saved_accumulate=1,
        new_dp_size=2 * live_groups,
        new_per_device_batch=4,
    )
    membership = ReplicaMembership(
        live_groups=live_groups,
        group_index=0,
        group_size=2,
        device_batch=4,
        accumulate=decision.accumulate_grad_batches,
    )
    assert membership.step_samples == 32
    assert committed_after(64, membership, dataset_len=1000) == 96


def test_group_remainder_matches_the_epoch_seed_order():
    # The order is the sampler's own: with one group of one rank and nothing committed, the rest is the whole epoch.
    sampler = ResumableSampler(10, num_replicas=1, rank=0, seed=_SEED)
    remainder = group_remainder(_order(10), 0, ReplicaMembership(live_groups=1, group_index=0, device_batch=2))
    assert remainder.ranks == (tuple(sampler),)
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(_SEED)).tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"live_groups": 0, "group_index": 0, "device_batch": 1},
            "ReplicaMembership(live_groups=0): must be an int >= 1",
        ),
        (
            {"live_groups": 2, "group_index": 2, "device_batch": 1},
            "ReplicaMembership(group_index=2): must be an int in [0, live_groups=2)",
        ),
        (
            {"live_groups": 2, "group_index": 0, "device_batch": 0},
            "ReplicaMembership(device_batch=0): must be an int >= 1",
        ),
        (
            {"live_groups": 2, "group_index": 0, "device_batch": 1, "accumulate": True},
            "ReplicaMembership(accumulate=True)",
        ),
    ],
)
def test_a_bad_membership_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ReplicaMembership(**kwargs)


def test_a_bad_order_or_count_is_refused():
    membership = ReplicaMembership(live_groups=1, group_index=0, device_batch=1)
    with pytest.raises(ValueError, match=r"must be a permutation of range\(3\)"):
        group_remainder([0, 0, 1], 0, membership)
    with pytest.raises(ValueError, match=r"committed=-1: must be an int >= 0"):
        group_remainder([0, 1, 2], -1, membership)
