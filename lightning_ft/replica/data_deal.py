"""The training data of a replica group: the rest of the epoch dealt anew over the live groups, so that every sample of
the epoch is trained exactly once in the committed history (lightning_ft/elastic/replica_data.py says why the deal
is exact).

The strategy's :class:`~lightning_ft.elastic.ResumableSampler` is held here for the fit: its ``consumed`` is the
**committed** count (stream positions trained in committed steps of the epoch), advanced at each commit by
:func:`~lightning_ft.elastic.replica_data.committed_after` and never by a discarded step (the per-batch advance of
:class:`~lightning_ft.elastic.dataloader.TrainingDataPosition` skips it). The rest of the epoch is dealt anew
(:func:`~lightning_ft.elastic.replica_data.reshard_sampler`):

- at the first micro-batch of a step whose quorum differs from the last one (live groups or this group's place),
  and on a group that just healed (its sampler carries the source's committed count): the batch fetched before the
  quorum belongs to the old deal and is put back; the first batch of the new deal is fetched in its place;
- right after a discarded step: its batches are the head of the next deal (the same batches again when the
  membership holds), and an epoch whose last step was discarded does not end.

Each time, the training DataLoader iterator is created anew (:func:`~lightning_ft._compat.restart_training_fetcher`)
and Lightning's batch progress is set so that the epoch ends on the new deal's last batch; on group rank 0 a
``replica_data`` event says what was dealt and which samples the rest of the epoch repeats or skips.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_ft import _compat
from lightning_ft.elastic.internal import (
    ReplicaMembership,
    committed_after,
    deal_changes,
    find_resumable_sampler,
    reshard_sampler,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.elastic import ResumableSampler

__all__ = ["ReplicaDataDeal"]

_log = logging.getLogger(__name__)


class ReplicaDataDeal:
    """Deals the training epoch over the live replica groups (see the module docstring); one per fit and process.

    Args:
        trainer: the running trainer.
        group_size: data-parallel ranks inside the group; ``local_rank`` this process's among them.
        write: writes an event (the caller writes on group rank 0 only).
        hold: told the sampler this deal holds, so that the per-batch advance leaves its count alone.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        *,
        group_size: int,
        local_rank: int,
        write: Callable[..., None],
        hold: Callable[[ResumableSampler], None],
    ) -> None:
        self._trainer = trainer
        self._hold = hold
        self._group_size = group_size
        self._local_rank = local_rank
        self._write = write
        self._key: tuple[Any, ...] | None = None  # (live groups, group index, members) of the current deal
        self._membership: ReplicaMembership | None = None
        self._sampler: ResumableSampler | None = None
        self._warned = False
        self._batches = 0  # batches this rank trained in the step that is running (its micro-batches)
        self.deals: list[dict[str, Any]] = []
        """One record per deal made anew: the ``replica_data`` event's fields."""

    def _held_sampler(self) -> ResumableSampler | None:
        loader = getattr(self._trainer, "train_dataloader", None)
        sampler = find_resumable_sampler(loader)
        if sampler is None:
            if not self._warned:
                self._warned = True
                _log.warning(
                    "replica groups: the training loader has no resumable sampler (a custom sampler, an"
                    " IterableDataset or several loaders); the epoch is not dealt anew over the live groups, so a lost"
                    " group's part of it is skipped"
                )
            return None
        if sampler is not self._sampler:  # a new loader (the first step, reload_dataloaders_every_n_epochs)
            self._sampler = sampler
            self._key = None
            self._hold(sampler)
        return sampler

    def forget_deal(self) -> None:
        """The sampler's state was replaced (a heal): the next quorum deals anew."""
        self._key = None

    def after_quorum(self, *, live_groups: int, group_index: int | None, members: tuple[str, ...], step: int) -> bool:
        """At the first micro-batch of a step, after the quorum: deal anew if the membership changed (the number of
        live groups, this group's index, or which groups: every group then restarts its iterator alike, which draws
        from the global RNG, so a healed group's RNG stays the survivors'). Returns whether the batch in hand is to
        be replaced (the caller then uses :meth:`refetch`)."""
        sampler = self._held_sampler()
        if sampler is None or group_index is None or live_groups < 1:
            return False
        # The epoch too: Lightning sized it from the sampler's length at set-up, before any deal.
        key = (live_groups, group_index, members, sampler.epoch)
        if key == self._key:
            return False
        same_groups = self._key is not None and self._key[:3] == key[:3]
        self._deal(sampler, key, step=step, reason="epoch" if same_groups else "membership")
        return True

    def count_batch(self) -> None:
        """One more training batch of the running step (every micro-batch, from the strategy's ``batch_to_device``)."""
        self._batches += 1

    def after_vote(self, committed: bool, *, step: int) -> None:
        """At the commit vote of a step: a commit advances the committed count by what the step trained (its
        micro-batches on every rank of every live group: a contiguous block of the stream); a discard deals the rest
        anew from the unchanged count (the next step trains the discarded batches again)."""
        sampler, membership = self._sampler, self._membership
        trained, self._batches = max(1, self._batches), 0
        if sampler is None or membership is None or self._key is None:
            return
        if committed:
            sampler.consumed = committed_after(
                sampler.consumed,
                dataclasses.replace(membership, accumulate=trained),
                dataset_len=sampler.dataset_len,
                drop_last=sampler.drop_last,
                drop_last_batch=sampler.drop_last_batch,
            )
            return
        self._deal(sampler, self._key, step=step, reason="discarded")
        # The discarded batch's own counts come after this (processed, completed): the epoch goes on.
        self._trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False

    def _deal(self, sampler: ResumableSampler, key: tuple[Any, ...], *, step: int, reason: str) -> None:
        trainer = self._trainer
        loader = trainer.train_dataloader
        membership = ReplicaMembership(
            live_groups=key[0],
            group_index=key[1],
            group_size=self._group_size,
            device_batch=int(loader.batch_size or 1),
            accumulate=int(trainer.accumulate_grad_batches),
        )
        committed = sampler.consumed
        reshard_sampler(sampler, membership, local_rank=self._local_rank, committed=committed)
        self._key, self._membership = key, membership
        batch = membership.device_batch
        left = sampler.remaining()
        batches = left // batch if bool(loader.drop_last) else math.ceil(left / batch)
        _realign(trainer, batches)
        record: dict[str, Any] = {
            "live_groups": key[0],
            "group_index": key[1],
            "committed": committed,
            "reason": reason,
        }
        if trainer.global_rank == 0:  # group rank 0: what the rest of the epoch repeats or skips (tensor ops)
            repeated, skipped = deal_changes(
                sampler._order_tensor(),
                committed,
                membership,
                drop_last=sampler.drop_last,
                drop_last_batch=sampler.drop_last_batch,
            )
            record["repeated"] = list(repeated)
            record["skipped"] = list(skipped)
            self._write("replica_data", step=step, **record)
        self.deals.append({"step": step, **record})

    def refetch(self, batch: Any) -> Any:
        """The first batch of the new deal in place of ``batch`` (fetched from the old one), through the same
        conversions Lightning applied before the strategy's ``batch_to_device``."""
        trainer = self._trainer
        fetcher = _compat.training_fetcher(trainer)
        if fetcher is None or fetcher.done:
            return batch  # nothing of the new deal left: the batch in hand is trained
        fresh, _, _ = next(fetcher)
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = fetcher.done
        fresh = trainer.precision_plugin.convert_input(fresh)
        return trainer.lightning_module._on_before_batch_transfer(fresh, dataloader_idx=0)


def _realign(trainer: pl.Trainer, batches: int) -> None:
    """Restart the training iterator on the new deal and set Lightning's batch progress so that the epoch ends after
    ``batches`` more batches (each fetched and counted ready by the loop, or by :meth:`ReplicaDataDeal.refetch`)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # A new DataLoader iterator draws its base seed from torch's global RNG. The draw is taken back: a deal made anew
    # leaves the random stream where it was, as under DDPStrategy (where no deal is made) and alike on every group.
    # Lightning sized the epoch at set-up from the sampler's length then; the deal's sampler has another (fewer live
    # groups: more batches each), and a loader capped at the old length would cut the deal short.
    rng = torch.get_rng_state()
    resized = _compat.resize_training_epoch(trainer)
    if resized is None:
        _compat.restart_training_fetcher(trainer, fetched=0)  # its length is the new deal's full epoch
    torch.set_rng_state(rng)
    accumulate = max(1, int(trainer.accumulate_grad_batches))
    if resized is not None and (resized - batches) % accumulate:
        # Lightning ends a step where its batch counter reaches a multiple of the accumulation: the deal's first
        # batch must start a step, and the epoch end where its count says (validation at the epoch's end).
        _compat.set_training_epoch_length(trainer, batches + max(0, resized - batches) // accumulate * accumulate)
    total = trainer.num_training_batches
    fetcher = _compat.training_fetcher(trainer)
    if fetcher is not None and fetcher.length is not None:
        fetcher.fetched = max(0, int(fetcher.length) - batches)
        fetcher.done = fetcher.fetched >= fetcher.length
    if math.isinf(total):
        return
    # Both call sites count the next batch ready after this: a membership deal is made before the loop counts the
    # batch it replaces, a discarded step's own batch is counted ready already.
    shift = max(0, int(total) - batches) - progress.current.ready
    if shift:
        for tracker in (progress.current, progress.total):
            tracker.ready += shift
            tracker.started += shift
            tracker.processed += shift
            tracker.completed += shift
