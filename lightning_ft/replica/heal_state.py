"""What a joining replica group copies from a healthy one: everything a Lightning checkpoint holds, plus RNG.

The state is Lightning's own checkpoint dump (``trainer._checkpoint_connector.dump_checkpoint``: weights, optimizer
and LR scheduler state, precision plugin state, loop progress with ``global_step``, callback and datamodule state,
the LightningModule's ``on_save_checkpoint`` additions) and this rank's RNG states, so that whatever a checkpoint
restores, a heal restores. It is put back through Lightning's own restore functions, in a running fit: the module's
``on_load_checkpoint`` and weights, the precision plugin, the callbacks, the loop progress (without marking the
loops as restarting, :func:`~lightning_ft._compat.load_fit_loop_progress`), the optimizers and schedulers, then the
RNG. Rank ``r`` of the joining group receives rank ``r``'s state of the source group (torchft pairs them); for a
sharded model (FSDP2, tensor parallel) that is rank ``r``'s shards (:mod:`~lightning_ft.replica.sharded_sync`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_ft import _compat
from lightning_ft.elastic.internal import find_resumable_sampler

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["apply_heal_state", "heal_state"]


def heal_state(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's state to send to a joining group. Called on torchft's quorum thread while the training thread
    waits for the quorum (nothing changes the state meanwhile); tensors are live references, serialized by the
    transport before the training thread continues."""
    connector = _compat.checkpoint_connector(trainer)
    sampler = find_resumable_sampler(getattr(trainer, "train_dataloader", None))
    return {
        "checkpoint": connector.dump_checkpoint(weights_only=False),
        "rng": _compat.collect_rng_states(),
        "sampler": sampler.state_dict() if sampler is not None else None,
    }


def apply_heal_state(
    trainer: pl.Trainer, state: dict[str, Any], *, load_in_place: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """Put ``state`` (from :func:`heal_state` on the source rank) into this running fit, in place.

    Called on the training thread at the start of a step, before the forward pass, on every rank of the joining
    group. ``load_in_place``: loads model and optimizer state that Lightning's restore leaves to the strategy (a
    sharded model's, :meth:`~lightning_ft.replica.sharded_sync.ShardedSync.load_heal_state`), first, as a checkpoint
    load does."""
    checkpoint = state["checkpoint"]
    if load_in_place is not None:
        load_in_place(checkpoint)
    with _compat.loaded_checkpoint(trainer, checkpoint) as connector:
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_precision_plugin_state()
        connector.restore_callbacks()
        if "loops" in checkpoint:
            _compat.load_fit_loop_progress(trainer, checkpoint["loops"]["fit_loop"])
        connector.restore_optimizers_and_schedulers()
    _continue_data(trainer, state.get("sampler"))
    _compat.set_rng_states(state["rng"])


def _continue_data(trainer: pl.Trainer, sampler_state: dict[str, Any] | None) -> None:
    """Take the source group's place in the epoch: its sampler state, whose ``consumed`` is the committed count (the
    replica mode's data deal keeps it so, lightning_ft/replica/data_deal.py). The quorum that brought the state then
    deals the rest of the epoch anew over the live groups, this one included, and replaces the batch this group had
    in hand with the first of its new deal: no batch is trained twice for a heal."""
    sampler = find_resumable_sampler(getattr(trainer, "train_dataloader", None))
    if sampler is None or sampler_state is None:
        return
    sampler.load_state_dict(sampler_state)
