"""A distributed sampler that resumes mid-epoch, at the same or at another world size.

Lightning's automatic ``DistributedSampler`` cannot resume mid-epoch: it has no state, so a restarted run either replays
the epoch from its start or skips data. :class:`ResumableSampler` yields exactly what ``DistributedSampler`` yields for
the same seed, and adds a state that does not depend on the world size: the epoch, the shuffle seed and the number of
*global* samples of the epoch already consumed. On resume, the rest of the epoch's global stream is dealt over the
replicas of the new world, so every sample of the epoch is still seen once (up to the new world's own end of epoch).
A run resumed with another seed finishes that epoch in the checkpoint's order and follows its own seed from the next
epoch on, as ``DistributedSampler`` built with the new seed does.

The strategy swaps it in for Lightning's sampler (see :func:`lightning_ft.elastic.swap_in_resumable_sampler`) and calls
:meth:`ResumableSampler.mark_consumed` once per training batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import Sampler

from lightning_ft.elastic.data_rng import SeededIndex, sample_seed

_STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "drop_last", "dataset_len")


class ResumableSampler(Sampler[int]):
    """Deal one global order per epoch over ``num_replicas`` replicas, resumable from a global sample offset.

    **The global stream.** For each epoch there is one global order of the dataset: ``torch.randperm`` from a
    ``torch.Generator`` seeded with ``seed + epoch`` when ``shuffle``, else ``range(N)``. Like ``DistributedSampler``,
    it is padded by repeating its head up to a multiple of ``num_replicas`` (or, with ``drop_last``, cut down to one),
    and global position ``i`` goes to replica ``i % num_replicas``. With nothing consumed, every replica yields exactly
    the indices ``torch.utils.data.DistributedSampler`` yields for the same arguments and epoch.

    **Resuming.** :meth:`state_dict` records ``consumed``, the number of global stream positions of the current epoch
    already trained on. After :meth:`load_state_dict`, the next :meth:`__iter__` deals the rest of the stream,
    ``stream[consumed:end]``, over the *current* ``num_replicas``, where ``end`` is where the current world's epoch
    ends: the stream's length, or, when the DataLoader drops its last partial batch (``drop_last_batch`` with
    ``batch_size``), the last position of its last full global batch. If that rest does not fill whole batches on
    every replica (only after a resume at another world size or batch size), it is completed by repeating its own
    head, so every replica yields the same number of batches and none is partial where partial batches are dropped:
    a resize never drops a sample of the rest of the epoch, and repeats fewer than one global batch (one sample per
    replica without ``drop_last_batch``). An epoch whose stream was exhausted by the world that saved it is over:
    such a state loads as the start of the next epoch. An epoch that the saving world had not finished but that has
    nothing left for the current world (it ends earlier, ``drop_last``) stays the current epoch with nothing left,
    and :meth:`completed_batches` reports it complete. Resumed on the same world size and batch size at a batch
    boundary, the replicas yield exactly what an uninterrupted run would have yielded for the rest of the epoch.

    **Length.** ``len(sampler)`` is the per-replica length of a *full* epoch on the current world, as for
    ``DistributedSampler``, also after a mid-epoch resume. Lightning sizes an epoch from it and, on a mid-epoch resume,
    restores its batch counter and then fetches batches until the count reaches that full size (see
    ``docs/elastic.md``). The rest of the epoch is therefore ``len(sampler) - <batches already done> * batch_size``
    samples long. On the same world size that holds by construction; after a resume at another world size, the loop's
    batch counter must be set to :meth:`completed_batches` of the new per-device batch size
    (:func:`lightning_ft.elastic.align_batch_progress` does that).

    Calling contract: every replica builds its own sampler with the same ``seed``, ``shuffle`` and ``drop_last``, and
    every replica calls :meth:`mark_consumed` with the same global count once per batch, so all replicas hold the same
    state and any one of them can be checkpointed.

    **Another seed.** A state taken with another ``seed`` (the run relaunched after ``seed_everything(2)``) loads: the
    rest of the epoch it was taken in keeps the order of the checkpoint's seed (each of its samples once), and every
    later epoch follows this sampler's ``seed``, as a ``DistributedSampler`` built with it does. One line on rank 0
    says which seed the data order follows.

    Example::

        sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
        for batch in loader:
            sampler.mark_consumed(8 * world_size)
            ...
        state = sampler.state_dict()  # {"epoch": 0, "consumed": ..., "seed": 42, ...}
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int | None = None,
        drop_last_batch: bool = False,
        per_sample_seeds: bool = False,
    ) -> None:
        dataset_len = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if isinstance(dataset_len, bool) or dataset_len < 0:
            raise ValueError(f"ResumableSampler(dataset_or_len={dataset_or_len!r}): the length must be an int >= 0")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"ResumableSampler(num_replicas={num_replicas!r}): must be an int >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler(rank={rank!r}): must be an int in [0, num_replicas={num_replicas})")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"ResumableSampler(batch_size={batch_size!r}): must be an int >= 1 or None")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.batch_size = batch_size
        """The DataLoader's per-replica batch size (``None``: unknown); with ``drop_last_batch`` it sets where the
        epoch ends and the unit a resumed rest is completed to."""
        self.drop_last_batch = bool(drop_last_batch) and batch_size is not None
        """Whether the DataLoader drops each replica's last partial batch (its ``drop_last``)."""
        self.per_sample_seeds = bool(per_sample_seeds)
        """Whether indices are yielded as :class:`~lightning_ft.elastic.data_rng.SeededIndex` (the opt-in per-sample
        seeding); otherwise plain ints, as ``DistributedSampler`` yields."""
        self.before_first_index: Callable[[], None] | None = None
        """Called, in the process that iterates the sampler, just before each iterator hands out its first index:
        with ``num_workers=0`` that is right before the first fetch of the iterator, with workers right after the
        DataLoader iterator is created. The strategy sets the RNG states of a mid-epoch resume there."""
        self.epoch = 0
        self.consumed = 0
        self._epoch_seed: int | None = None  # the order's seed for the current epoch when it is not `seed` (a resume)
        # Set when an iterator has handed out the whole rest of the epoch: the next iter() is a new pass over the
        # same epoch (CombinedLoader cycles a shorter loader), not a resume at `consumed`. DataLoader creates the
        # sampler iterator twice per iterator with workers, so only issuing everything flips it, and consuming a
        # batch of the new pass (or set_epoch, load_state_dict) clears it.
        self._new_pass = False

    @property
    def num_samples(self) -> int:
        """Samples per replica in a full epoch on the current world: ``DistributedSampler.num_samples``."""
        if self.drop_last:
            return self.dataset_len // self.num_replicas
        return math.ceil(self.dataset_len / self.num_replicas)

    @property
    def total_size(self) -> int:
        """Length of the global stream of a full epoch on the current world (padding included)."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def _global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        return self._order_tensor().tolist()

    def _order_tensor(self) -> torch.Tensor:
        """The epoch's order (:meth:`_global_order`) as a tensor, for vectorized readers of the whole epoch."""
        if not self.shuffle:
            return torch.arange(self.dataset_len, dtype=torch.int64)
        generator = torch.Generator()
        generator.manual_seed(self.order_seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    @property
    def order_seed(self) -> int:
        """The seed of the current epoch's order: :attr:`seed`, or the checkpoint's for the rest of an epoch resumed
        from a state taken with another seed."""
        return self.seed if self._epoch_seed is None else self._epoch_seed

    @property
    def epoch_end(self) -> int:
        """Stream position where the current world's epoch ends: :attr:`total_size`, or with ``drop_last_batch`` the
        end of the last full global batch (per-device batch x replicas)."""
        if self.drop_last_batch:
            assert self.batch_size is not None
            global_batch = self.batch_size * self.num_replicas
            return self.total_size // global_batch * global_batch
        return self.total_size

    @property
    def exhausted(self) -> bool:
        """Whether the current epoch is over for every world: the world that consumed it reached its end of epoch
        (:meth:`mark_consumed` then records at least the dataset length)."""
        return self.consumed >= self.dataset_len > 0

    def _remaining_stream(self, start: int | None = None) -> list[tuple[int, int]]:
        """``(index, position)`` of the global stream of the current epoch from position ``start`` (default:
        ``consumed``) to the current world's end of epoch, completed to whole batches on every replica."""
        start = self.consumed if start is None else start
        end = self.epoch_end
        if start >= self.dataset_len or start >= end:
            return []
        order = self._global_order()
        stream = order[: self.total_size] if self.drop_last else _pad(order, self.total_size)
        rest = list(zip(stream[start:end], range(start, end), strict=True))
        unit = self.num_replicas * (self.batch_size if self.drop_last_batch else 1)  # type: ignore[operator]
        uneven = len(rest) % unit
        if uneven:
            # Only after a resume at another world or batch size: the rest no longer fills whole batches on every
            # replica. Replicas yielding different numbers of batches would hang the collectives, and a partial batch
            # the DataLoader drops would lose samples; repeating the head of the rest avoids both. A repeat sits at a
            # new position, so it gets a seed of its own.
            extra = _pad(rest, len(rest) - uneven + unit)[len(rest) :]
            rest += [(index, self.total_size + i) for i, (index, _) in enumerate(extra)]
        return rest

    def _rest_length(self, start: int | None = None) -> int:
        """``len(self._remaining_stream(start))``, by arithmetic."""
        start = self.consumed if start is None else start
        end = self.epoch_end
        if start >= self.dataset_len or start >= end:
            return 0
        unit = self.num_replicas * (self.batch_size if self.drop_last_batch else 1)  # type: ignore[operator]
        return math.ceil((end - start) / unit) * unit

    def _replica_stream(self, start: int | None = None) -> tuple[list[int], list[int]]:
        """``(indices, positions)`` of this replica's share of :meth:`_remaining_stream` (its ``[rank::num_replicas]``
        slice), built with tensor operations: an iterator is created at every epoch and, in the replica mode, twice
        per lost group, and the list of the whole rest took a Python loop over the epoch."""
        start = self.consumed if start is None else start
        total = self._rest_length(start)
        if total == 0:
            return [], []
        end = self.epoch_end
        # The stream holds order[k % n] at position k: cut to total_size (drop_last) or padded by repeating its head.
        positions = torch.arange(start, end, dtype=torch.int64)
        indices = self._order_tensor()[positions % self.dataset_len]
        extra = total - positions.numel()
        if extra:  # the head of the rest again, at new positions past the stream's end
            indices = torch.cat([indices, indices[torch.arange(extra) % positions.numel()]])
            positions = torch.cat([positions, self.total_size + torch.arange(extra, dtype=torch.int64)])
        return indices[self.rank :: self.num_replicas].tolist(), positions[self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        # Built eagerly, like DistributedSampler: the iterator is fixed when created, so a later mark_consumed (the
        # loop runs behind a prefetching DataLoader) does not shift the batches already being served.
        indices, positions = self._replica_stream(0 if self._new_pass else None)
        if not self.per_sample_seeds:
            return self._issue(indices)
        # Each index carries its sample's seed (see lightning_ft.elastic.data_rng); it is the same int otherwise.
        return self._issue(
            [
                SeededIndex(index, sample_seed(self.order_seed, self.epoch, pos))
                for index, pos in zip(indices, positions, strict=True)
            ]
        )

    def __getstate__(self) -> dict[str, Any]:
        # The hook belongs to the run of the process that set it (the strategy's tracker, which holds the run's
        # event log and checkpoint writer): a pickled or deep-copied sampler (`torch.save(trainer)`, a DataLoader
        # sent to a spawned worker) has none.
        return {**self.__dict__, "before_first_index": None}

    def _issue(self, indices: list[int]) -> Iterator[int]:
        # A generator: this runs at the first next(), which BatchSampler calls right before the batch is fetched.
        if indices and self.before_first_index is not None:
            self.before_first_index()
        yield from indices
        self._new_pass = True

    def remaining(self) -> int:
        """Samples this replica still yields in the current epoch (``len(list(iter(self)))``)."""
        return self._rest_length() // self.num_replicas

    def completed_batches(self, batch_size: int | None = None, *, drop_last: bool | None = None) -> int:
        """Batches of ``batch_size`` per replica that count as done in the current epoch on the current world.

        This is the value Lightning's batch progress must hold on resume so that the epoch ends on its last remaining
        batch: the full epoch's batch count minus the batches still to come (all of them when the epoch has nothing
        left for this world). On the same world size, resumed at a batch boundary, it equals the number of batches
        trained before the save. ``batch_size`` and ``drop_last`` are the DataLoader's; they default to the
        sampler's own ``batch_size`` and ``drop_last_batch``.
        """
        batch_size = self.batch_size if batch_size is None else batch_size
        drop_last = self.drop_last_batch if drop_last is None else drop_last
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"completed_batches(batch_size={batch_size!r}): must be an int >= 1")

        def batches(samples: int) -> int:
            return samples // batch_size if drop_last else math.ceil(samples / batch_size)

        return batches(self.num_samples) - batches(self.remaining())

    def mark_consumed(self, n_global_samples: int) -> None:
        """Record that ``n_global_samples`` more samples of the global stream were trained on.

        Call it once per training batch, on every replica, with the global batch: per-device batch size times the
        data-parallel size. At the end of the current world's epoch the count becomes ``max(epoch_end,
        dataset_len)``, so a short last batch needs no care and every world reads the epoch as over.
        """
        if isinstance(n_global_samples, bool) or not isinstance(n_global_samples, int) or n_global_samples < 0:
            raise ValueError(f"mark_consumed(n_global_samples={n_global_samples!r}): must be an int >= 0")
        if self.consumed >= max(self.epoch_end, self.dataset_len) > 0 and n_global_samples:
            # The pass is complete and batches keep coming: a shorter loader cycled within the epoch starts over.
            self.consumed = 0
            self._new_pass = False
        self.consumed += n_global_samples
        if self.consumed >= self.epoch_end:
            # The epoch is over for this world. Recorded as at least the dataset length, so that a world on which
            # the epoch ends later (drop_last) also reads it as over, rather than training the samples this world
            # dropped at the end of the epoch.
            self.consumed = max(self.epoch_end, self.dataset_len)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order and nothing consumed. The epoch being resumed keeps its offset.

        Lightning calls this at the start of every epoch, including the one it resumes mid-way.
        """
        if epoch != self.epoch:
            self.consumed = 0
            self._epoch_seed = None
        self.epoch = int(epoch)
        self._new_pass = False

    def state_dict(self) -> dict[str, Any]:
        """Plain, world-size-independent state: ``epoch``, ``consumed`` (global samples), ``seed`` (the current epoch's
        order's: :attr:`order_seed`), ``shuffle``, ``drop_last`` and ``dataset_len``."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.order_seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a sampler on any world size; takes effect at the next ``iter()``.

        A state whose epoch was over for the world that saved it loads as the start of the next epoch. A state taken
        with another seed loads too: the rest of its epoch keeps the checkpoint's order, later epochs follow
        :attr:`seed` (said in one line on rank 0).

        Raises:
            ValueError: if ``state`` lacks a key, or its dataset length, shuffle or drop_last differ from this
                sampler's (the order would not be the one the checkpoint was taken in).
        """
        self._load(state, announce=True)

    def _load(self, state: dict[str, Any], *, announce: bool) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"ResumableSampler.load_state_dict: the state lacks {missing}; got keys {sorted(state)}")
        for key in ("dataset_len", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler.load_state_dict: the checkpoint was taken with {key}={state[key]!r} but this "
                    f"sampler has {key}={getattr(self, key)!r}; resuming would not continue the same order"
                )
        if int(state["consumed"]) < 0 or int(state["epoch"]) < 0:
            raise ValueError(f"ResumableSampler.load_state_dict: epoch and consumed must be >= 0, got {state!r}")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self._new_pass = False
        saved_seed = int(state["seed"])
        self._epoch_seed = None if saved_seed == self.seed else saved_seed
        if self.exhausted:
            # Saved on the last batch of an epoch: Lightning resumes with the next epoch, but may build the DataLoader
            # iterator (and, with workers, prefetch from this sampler) before it calls set_epoch. Starting the next
            # epoch here keeps that iterator from being empty. An epoch that is over only for this world (it ends
            # earlier here) is not rolled over: Lightning resumes it mid-way and must see it end, not start again.
            self.epoch += 1
            self.consumed = 0
            self._epoch_seed = None
        if announce and saved_seed != self.seed:
            rank_zero_info(self._seed_message(saved_seed))

    def _seed_message(self, saved_seed: int) -> str:
        order = "order" if self.shuffle else "per-sample seeds" if self.per_sample_seeds else None
        if order is None:  # in order and no seeded samples: the seed changes nothing
            return f"lightning-ft: the checkpoint was taken with seed={saved_seed}, this run has seed={self.seed}"
        if self._epoch_seed is None:
            return (
                f"lightning-ft: the checkpoint was taken with seed={saved_seed}, this run has seed={self.seed}: the data"
                f" {order} follows seed={self.seed} from epoch {self.epoch} on, as DDPStrategy's sampler does"
            )
        return (
            f"lightning-ft: the checkpoint was taken with seed={saved_seed}, this run has seed={self.seed}: the rest of"
            f" epoch {self.epoch} keeps the checkpoint's data {order} (seed={saved_seed}, each sample once), and from"
            f" epoch {self.epoch + 1} on it follows seed={self.seed}, as DDPStrategy's sampler does"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_len={self.dataset_len}, num_replicas={self.num_replicas}, rank={self.rank},"
            f" shuffle={self.shuffle}, seed={self.seed}, order_seed={self.order_seed}, drop_last={self.drop_last}, batch_size={self.batch_size},"
            f" drop_last_batch={self.drop_last_batch}, epoch={self.epoch},"
            f" consumed={self.consumed})"
        )


def _pad(indices: list[int], size: int) -> list[int]:
    """``indices`` extended to ``size`` by repeating its head, exactly as ``DistributedSampler`` pads."""
    padding = size - len(indices)
    if padding <= 0:
        return indices
    if padding <= len(indices):
        return indices + indices[:padding]
    return indices + (indices * math.ceil(padding / len(indices)))[:padding]
