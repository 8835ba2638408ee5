"""Swap a :class:`ResumableSampler` into the training DataLoader the user already has.

Users keep their ``DataLoader(dataset, batch_size=..., shuffle=True)`` code. With ``use_distributed_sampler=True``
(Lightning's default), Lightning replaces its sampler with a ``DistributedSampler`` before the strategy's
``process_dataloader`` sees it; there, :func:`swap_in_resumable_sampler` rebuilds the DataLoader around a
:class:`ResumableSampler` with the same ``shuffle``, ``seed`` and ``drop_last``, so training sees the same samples in
the same order, and the position in the epoch survives a restart. Rebuilding goes through Lightning's own
``_update_dataloader``, which re-instantiates DataLoader subclasses with their original arguments.

The rebuilt DataLoader also exposes ``state_dict()`` and ``load_state_dict()`` (its sampler's). That makes it
*stateful* to Lightning: the fit loop saves the sampler state with its own loop state in every checkpoint
(``checkpoint["loops"]["fit_loop"]["combined_loader"]``) and, on a mid-epoch resume, loads it back before the first
batch is fetched, without a "dataloader is not resumable" warning.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_ft import _compat
from lightning_ft.elastic.data_rng import install_seeded_fetch
from lightning_ft.elastic.resumable_sampler import ResumableSampler

_info_cache = WarningCache()


def swap_in_resumable_sampler(
    dataloader: Any, *, num_replicas: int, rank: int, epoch: int | None = None, plain_samplers: bool = True
) -> Any:
    """Return ``dataloader`` rebuilt around a :class:`ResumableSampler`, or unchanged where that is not possible.

    Replaced: a ``DistributedSampler`` (what Lightning injects), a ``RandomSampler`` without replacement and a
    ``SequentialSampler`` (unless ``plain_samplers=False``), or a ``ResumableSampler`` built for another
    ``num_replicas``/``rank`` (its state is kept). ``ElasticFT3D`` passes ``plain_samplers=False``: a plain sampler
    reaches it only with ``Trainer(use_distributed_sampler=False)``, where ``DDPStrategy`` keeps it as it is (every
    rank reads the whole dataset, in an order drawn from the global RNG), so it is kept too.
    The new sampler takes ``shuffle``, ``seed`` and ``drop_last`` from a ``DistributedSampler``; for the plain samplers
    ``shuffle`` follows the sampler type and the seed is Lightning's global seed (``PL_GLOBAL_SEED``, as Lightning
    uses for the ``DistributedSampler`` it injects), with ``drop_last=False``.

    Left as they are, with a one-time info message: anything that is not a ``DataLoader``, an ``IterableDataset``, a
    custom sampler (including a ``DistributedSampler`` subclass or Lightning's ``DistributedSamplerWrapper``) and a
    custom batch sampler. Their position in an epoch is not resumable.

    ``num_replicas`` and ``rank`` are the data-parallel size and this rank's data-parallel index (tensor- and
    pipeline-parallel peers read the same samples). Call it on every rank; it does no communication.

    ``epoch``, if given, is passed to the sampler's ``set_epoch``. From ``Strategy.process_dataloader`` pass
    ``trainer.fit_loop.epoch_progress.current.processed``, the epoch Lightning passes to ``set_epoch`` itself: on a
    resume Lightning creates the DataLoader iterator before its own ``set_epoch`` call and keeps it, so with
    ``num_workers > 0`` the indices prefetched then must already belong to the right epoch.
    """
    if not isinstance(dataloader, DataLoader):
        _info_cache.info(f"lightning-ft: {type(dataloader).__name__} is not a DataLoader; its epoch is not resumable.")
        return dataloader
    if isinstance(dataloader.dataset, IterableDataset):
        if not saves_own_position(dataloader):
            _info_cache.info(
                "lightning-ft: the training DataLoader reads an IterableDataset; its position within an epoch is not"
                " resumable (make the dataset itself stateful to resume mid-epoch)."
            )
        return dataloader
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler) is not BatchSampler:
        _info_cache.info(
            f"lightning-ft: the training DataLoader uses a custom batch sampler"
            f" ({type(dataloader.batch_sampler).__name__}); it is kept, and its epoch is not resumable."
        )
        return dataloader
    sampler = dataloader.sampler
    if isinstance(sampler, ResumableSampler) and (sampler.num_replicas, sampler.rank) == (num_replicas, rank):
        sampler.batch_size = dataloader.batch_size
        sampler.drop_last_batch = bool(dataloader.drop_last) and dataloader.batch_size is not None
        return _make_stateful(dataloader, sampler, epoch)
    new_sampler = _resumable_replacement(
        sampler, dataloader, num_replicas=num_replicas, rank=rank, plain_samplers=plain_samplers
    )
    if new_sampler is None:
        replaced = "DistributedSampler, RandomSampler and SequentialSampler" if plain_samplers else "DistributedSampler"
        _info_cache.info(
            f"lightning-ft: the training DataLoader uses a custom sampler ({type(sampler).__name__}); it is kept, and"
            f" its epoch is not resumable. Lightning-ft replaces only {replaced}."
        )
        return dataloader
    return _make_stateful(_compat.update_dataloader(dataloader, new_sampler), new_sampler, epoch)


def saves_own_position(dataloader: Any) -> bool:
    """Whether ``dataloader`` is stateful by itself (Lightning's ``_Stateful`` protocol: ``state_dict`` and
    ``load_state_dict``, as litData's ``StreamingDataLoader`` or torchdata's ``StatefulDataLoader`` have) and was not
    made so by :func:`swap_in_resumable_sampler`. Lightning saves such a loader's state with the loop state in every
    checkpoint and loads it back on a resume: where the position within the epoch is, is the loader's own business."""
    return (
        callable(getattr(dataloader, "state_dict", None))
        and callable(getattr(dataloader, "load_state_dict", None))
        and find_resumable_sampler(dataloader) is None
    )


def find_resumable_sampler(dataloader: Any) -> ResumableSampler | None:
    """The :class:`ResumableSampler` that ``dataloader`` draws from, or ``None``."""
    for sampler in (
        getattr(dataloader, "sampler", None),
        getattr(getattr(dataloader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(sampler, ResumableSampler):
            return sampler
    return None


def align_batch_progress(trainer: Any) -> int:
    """Set the epoch loop's batch counter to the resumed sampler's position, in batches of the current DataLoader.

    Lightning restores the number of batches done in the epoch from the checkpoint and fetches batches until the
    epoch's full count (``len(dataloader)``) is reached. After a resume at another data-parallel size or per-device
    batch size, the restored count is in the old batches; this rewrites it (current and total, keeping the shape
    Lightning's restart logic reads) to :meth:`ResumableSampler.completed_batches` of the new batch size, so the epoch
    ends on its last remaining batch. On the same sizes at a batch boundary it changes nothing.

    Call it from ``Strategy.on_train_start`` (the sampler state is loaded by then and the epoch loop has not started),
    on every rank; no communication. Returns the shift applied, in batches.
    """
    loader = getattr(trainer, "train_dataloader", None)
    sampler = find_resumable_sampler(loader)
    batch_size = getattr(loader, "batch_size", None)
    if sampler is None or not batch_size or not trainer.fit_loop.restarting:
        # Not restarting: a fresh fit, or a resume whose epoch was over (Lightning's FitLoop.restarting). The epoch
        # loop zeroes the current count at the next epoch's start and the sampler starts that epoch: nothing to align,
        # and a shift would only take the old epoch's batches off the total count.
        return 0
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = sampler.completed_batches(batch_size, drop_last=bool(loader.drop_last)) - progress.current.ready
    if shift:
        for tracker in (progress.current, progress.total):
            tracker.ready += shift
            tracker.started += shift
            tracker.processed += shift
            tracker.completed += shift
    return shift


def _resumable_replacement(
    sampler: Sampler, dataloader: DataLoader, *, num_replicas: int, rank: int, plain_samplers: bool
) -> ResumableSampler | None:
    dataset = dataloader.dataset
    kind = type(sampler)
    # The DataLoader's batching decides where an epoch ends with drop_last, and what a resumed rest is completed to.
    batching = {
        "num_replicas": num_replicas,
        "rank": rank,
        "batch_size": dataloader.batch_size,
        "drop_last_batch": bool(dataloader.drop_last),
    }
    if isinstance(sampler, ResumableSampler):
        new = ResumableSampler(
            sampler.dataset_len, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last, **batching
        )
        new._load(sampler.state_dict(), announce=False)  # the same run's sampler, rebuilt: nothing to say
        return new
    # Exact types only: a subclass may change the order, and reproducing it is its author's business.
    if kind is DistributedSampler:
        return ResumableSampler(
            dataset, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last, **batching
        )
    if not plain_samplers:
        return None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if kind is RandomSampler and not sampler.replacement and sampler.num_samples == len(dataset):
        return ResumableSampler(dataset, shuffle=True, seed=seed, **batching)
    if kind is SequentialSampler:
        return ResumableSampler(dataset, shuffle=False, seed=seed, **batching)
    return None


def _make_stateful(dataloader: DataLoader, sampler: ResumableSampler, epoch: int | None) -> DataLoader:
    if epoch is not None:
        sampler.set_epoch(epoch)
    # Instance attributes, not a subclass: the user's DataLoader class stays what it is, and Lightning's `_Stateful`
    # protocol check only asks for the two methods.
    dataloader.state_dict = sampler.state_dict
    dataloader.load_state_dict = sampler.load_state_dict
    return dataloader


class ResumeRngHooks(Protocol):
    """Where a resume's RNG states are set (the strategy's tracker)."""

    def before_training_iterator(self, trainer: Any) -> None: ...

    def before_first_fetch(self) -> None: ...


class TrainingDataPosition:
    """The resumable samplers of the training DataLoaders, each advanced by its global batch per training batch, and
    what a resume of them can and cannot restore.

    The strategy passes every dataloader through :meth:`prepare` (from ``Strategy.process_dataloader``) and calls
    :meth:`advance` once per training batch on every rank. Several training loaders (a list or dict, a
    ``CombinedLoader``) are tracked each; in the modes where every training batch draws from every loader
    (``"max_size_cycle"``, the default, ``"max_size"`` and ``"min_size"``). In ``"sequential"`` mode a batch comes from
    one loader at a time and positions are not tracked (a one-time message says so). Not thread-safe.

    Args:
        per_sample_seeds: ``ElasticFT3D(data_randomness="per_sample")``: the swapped-in samplers yield seeded indices
            and their datasets get the seeded ``__getitems__`` of :mod:`lightning_ft.elastic.data_rng`. Off (the
            default), the data pipeline draws from the RNGs exactly as under ``DDPStrategy``.
    """

    def __init__(self, *, per_sample_seeds: bool = False) -> None:
        self.per_sample_seeds = per_sample_seeds
        self.resume_rng: ResumeRngHooks | None = None
        """Told, on every rank, when Lightning is about to create the training iterator (:meth:`prepare_for` of a
        training loader) and when a swapped-in sampler hands out an iterator's first index (its
        :attr:`~lightning_ft.elastic.ResumableSampler.before_first_index`): where a resume's RNG states are set."""
        # Loaders of earlier set-ups (reload_dataloaders_every_n_epochs) drop out when Lightning lets go of them.
        self._tracked: weakref.WeakKeyDictionary[DataLoader, tuple[ResumableSampler, int]] = weakref.WeakKeyDictionary()
        self._seeded_datasets: dict[str, None] = {}  # class names, in order, without repeats
        # Training loaders that save their own position (saves_own_position), of the current set-up.
        self._self_stateful: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()
        # Why a resume of the training data is not exact: reason -> whether it holds at an epoch boundary too.
        self._inexact: dict[str, bool] = {}
        self._announced_seeding = False
        # Samplers whose count another part keeps (the replica mode's committed count): advance() leaves them.
        self._held: weakref.WeakSet[ResumableSampler] = weakref.WeakSet()
        # Between stages (stage_ended, stage_starts): the tracked loaders are not stateful.
        self._outside_stage = False

    def hold(self, sampler: ResumableSampler) -> None:
        """From now on :meth:`advance` leaves ``sampler``'s count alone: the replica mode advances it per committed
        step (lightning_ft/replica/data_deal.py)."""
        self._held.add(sampler)

    def prepare_for(self, trainer: Any, dataloader: Any, *, num_replicas: int, rank: int) -> Any:
        """:meth:`prepare` for the stage ``trainer`` is in (``None``: not attached yet; returned unchanged)."""
        if trainer is None:
            return dataloader
        if trainer.training and self.resume_rng is not None:
            # Lightning creates the training iterator right after it has processed the training loaders.
            self.resume_rng.before_training_iterator(trainer)
        return self.prepare(
            dataloader,
            training=trainer.training,
            epoch=trainer.fit_loop.epoch_progress.current.processed,
            mode=_compat.train_combined_loader_mode(trainer),
            num_replicas=num_replicas,
            rank=rank,
        )

    def prepare(
        self, dataloader: Any, *, training: bool, epoch: int, num_replicas: int, rank: int, mode: str | None = None
    ) -> Any:
        """For training, swap in a :class:`ResumableSampler` (for Lightning's ``DistributedSampler``) and note what a
        resume of the loader cannot restore; other loaders are returned as they are.

        ``num_replicas`` and ``rank`` are the data-parallel size and this rank's data-parallel index; ``mode`` is the
        training ``CombinedLoader``'s mode.
        """
        if not training:
            return dataloader
        if mode == "sequential":
            _info_cache.info(
                "lightning-ft: the training loaders are combined in 'sequential' mode; their positions within an"
                " epoch are not resumable."
            )
            self._inexact["the training loaders are combined in 'sequential' mode, whose position is not saved"] = False
            return dataloader
        # The swapped-in loader is stateful, so Lightning saves and restores its position with the loop state.
        swapped = swap_in_resumable_sampler(
            dataloader, epoch=epoch, num_replicas=num_replicas, rank=rank, plain_samplers=False
        )
        sampler = getattr(swapped, "sampler", None)
        if not isinstance(sampler, ResumableSampler):
            if saves_own_position(swapped):
                self._self_stateful[swapped] = None
            else:
                self._inexact[f"{_loader_kind(dataloader)} does not save its position within the epoch"] = False
            return swapped
        workers = int(swapped.num_workers or 0)
        # Without workers a sampler hands out a batch's indices right before the main process fetches it. With workers
        # it does so while the DataLoader iterator is created, before Lightning creates the next loader's iterator
        # (which draws a base seed); those fetches draw nothing in the main process, so the tracker's
        # on_train_batch_start is early enough.
        hook = self.resume_rng.before_first_fetch if self.resume_rng is not None and not workers else None
        sampler.before_first_index = hook
        seeded = self.per_sample_seeds and install_seeded_fetch(swapped.dataset)
        sampler.per_sample_seeds = seeded
        if seeded:
            self._seeded_datasets[type(swapped.dataset).__name__] = None
        if workers and swapped.persistent_workers:
            self._inexact[
                f"a training DataLoader keeps persistent_workers: its {workers} workers carry their random streams"
                " from epoch to epoch, and a resumed run starts new ones"
            ] = True
        elif workers and not seeded:
            self._inexact[
                f"randomness drawn in the {workers} DataLoader workers of a training loader is not restored in the"
                " middle of an epoch (new workers start from new seeds); ElasticFT3D(data_randomness='per_sample')"
                " makes it exact"
            ] = False
        # One batch consumes batch_size x dp global samples.
        self._tracked[swapped] = (sampler, (swapped.batch_size or 1) * num_replicas)
        return swapped

    def finish_resumed_epoch(self, trainer: Any) -> None:
        """At the end of the epoch a fit resumed in the middle of, let the iterators of the training loaders that save
        their own position (:func:`saves_own_position`) end as they end in an uninterrupted epoch.

        Lightning counts the batches of a resumed epoch from the restored loop state and stops once the epoch's length
        is reached, without the one more ``next()`` that raises ``StopIteration``. A loader that restored its own
        position has then handed out its last batch, but its iterator never finished, and what such a loader does
        when an epoch's iteration ends is not done: litData's ``StreamingDataLoader`` keeps its restored state, and
        its next ``iter()`` replays the rest of the resumed epoch instead of starting the next one (also under
        ``DDPStrategy``). Here each such iterator is asked for one more batch; it has none, so it ends. One that still
        has a batch (its length is more than Lightning took) is left as it is, that batch unused.

        Call it from ``on_train_epoch_end`` of that epoch, on every rank; only when the epoch ran to its last batch
        (``batch_progress.is_last_batch``) and was not shortened (``limit_train_batches``); no communication."""
        if not self._self_stateful or not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return
        for loader, iterator in _compat.train_loader_iterators(trainer):
            if loader not in self._self_stateful or sized_len(loader) != trainer.num_training_batches:
                continue
            try:
                next(iterator)
            except StopIteration:
                pass

    def stage_ended(self) -> None:
        """The stage is over (the strategy's ``teardown``): the training loaders this made stateful stop being so
        until :meth:`stage_starts`, as the loaders of a ``DDPStrategy`` run are not. Lightning's fit loop keeps them
        after ``fit`` returns (or raises), and its ``state_dict()`` then lists no loader state, as under
        ``DDPStrategy``; a save outside a stage gets their positions from :meth:`loop_state_outside_stage`."""
        for loader, (sampler, _) in list(self._tracked.items()):
            if loader.__dict__.get("state_dict") == sampler.state_dict:
                del loader.state_dict, loader.load_state_dict
        self._outside_stage = True

    def stage_starts(self) -> None:
        """A stage starts (the strategy's ``setup_environment``): the training loaders of an earlier ``fit`` that
        Lightning still holds (its fit loop reuses them unless asked to reload) are stateful again, before any
        restore or save of the loop state."""
        for loader, (sampler, _) in list(self._tracked.items()):
            _make_stateful(loader, sampler, epoch=None)
        self._outside_stage = False

    def loop_state_outside_stage(self, loops: Any, train_loaders: list[Any]) -> Any:
        """Lightning's loop state ``loops`` of a save outside a stage (``trainer.save_checkpoint`` after ``fit``)
        with the training loaders' states as a stage lists them: the sampler position of each loader this made
        stateful (:meth:`stage_ended`), in its place among ``train_loaders`` (the fit loop's, in order). ``loops``
        as it is inside a stage, or when no such loader is among ``train_loaders``."""
        if not self._outside_stage or not any(loader in self._tracked for loader in train_loaders):
            return loops
        states = [
            self._tracked[loader][0].state_dict() if loader in self._tracked else loader.state_dict()
            for loader in train_loaders
            if loader in self._tracked or saves_own_position(loader)
        ]
        fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
        if not isinstance(fit_loop, dict):
            return loops
        state_dict = {**(fit_loop.get("state_dict") or {}), "combined_loader": states}
        return {**loops, "fit_loop": {**fit_loop, "state_dict": state_dict}}

    def advance(self) -> None:
        """One training batch was consumed on every data-parallel rank, from every tracked loader."""
        for sampler, global_batch in list(self._tracked.values()):
            if sampler not in self._held:
                sampler.mark_consumed(global_batch)

    def training_starts(self, resume_point: str | None, train_dataloader: Any = None) -> None:
        """Say, on rank 0, which training datasets fetch with seeded RNGs and why (``per_sample_seeds``: once per
        instance), and why a resume is not exact (``resume_point``: ``"mid_epoch"``, ``"epoch_boundary"`` or ``None``,
        not resuming; ``train_dataloader``: ``trainer.train_dataloader``). Call it from ``on_train_start``, on every
        rank: the loaders are prepared by then."""
        if resume_point is not None and _unsized(train_dataloader):
            # Lightning's _PrefetchDataFetcher fetches one batch ahead when the training length is unknown: the batch
            # after the save was fetched before it, from a stream the resumed run has already moved past.
            self._inexact[
                "a training loader has no length, so Lightning fetched the batch after the save before the save"
            ] = False
        if resume_point is not None:
            reasons = self.resume_not_exact_because(mid_epoch=resume_point == "mid_epoch")
            if reasons:
                rank_zero_info(f"lightning-ft: this resume is not exact: {'; '.join(reasons)}.")
        self._inexact = {}  # the next fit prepares its own loaders
        if self._announced_seeding or not self._seeded_datasets:
            return
        self._announced_seeding = True
        names = ", ".join(self._seeded_datasets)
        rank_zero_info(
            f"lightning-ft: data_randomness='per_sample': the training datasets {names} fetch every sample with"
            " torch's (CPU), Python's and numpy's RNGs seeded from its place in the epoch, so that their"
            " augmentation resumes exactly with DataLoader workers and is the same at any world size; the numbers"
            " drawn differ from DDPStrategy's."
        )

    def resume_not_exact_because(self, *, mid_epoch: bool) -> list[str]:
        """Why a resume of the prepared training loaders is not exact (empty: it is), for a resume in the middle of
        an epoch or at an epoch boundary (no batch of the epoch left)."""
        return [reason for reason, always in self._inexact.items() if mid_epoch or always]


def _unsized(train_dataloader: Any) -> bool:
    if isinstance(train_dataloader, dict):
        loaders = list(train_dataloader.values())
    elif isinstance(train_dataloader, (list, tuple)):
        loaders = list(train_dataloader)
    else:
        loaders = [] if train_dataloader is None else [train_dataloader]
    return any(sized_len(loader) is None for loader in loaders)


def _loader_kind(dataloader: Any) -> str:
    if not isinstance(dataloader, DataLoader):
        return f"the training loader {type(dataloader).__name__} (not a DataLoader)"
    if isinstance(dataloader.dataset, IterableDataset):
        return f"the training DataLoader over the IterableDataset {type(dataloader.dataset).__name__}"
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler) is not BatchSampler:
        return f"the training DataLoader's batch sampler {type(dataloader.batch_sampler).__name__}"
    name = type(dataloader.sampler).__name__
    if name == "DistributedSamplerWrapper":
        name += " (Lightning's wrapper of a custom sampler)"
    return f"the training DataLoader's sampler {name}"
