"""Replica groups of a sharded model: FSDP2 (``fully_shard``) or tensor parallelism inside each group, the groups
joined across by torchft (HSDP as torchtitan runs it with torchft).

Inside a group the model's parameters are DTensors after ``configure_model()``: FSDP2 reduce-scatters the gradients
over the group's ``"data_parallel"`` mesh axis, tensor parallelism reduces its own partial results, and each rank ends
a backward pass with the gradient of its own shards. Every group lays its shards out alike, so rank ``r`` of one group
holds the same shards as rank ``r`` of another; torchft's Managers are per rank and join rank ``r`` of each group
with rank ``r`` of the others. What differs from a data-parallel group is therefore only what is per rank:

- the cross-group average (:meth:`ShardedSync.average_gradients`): after the step's last backward and before the
  precision plugin's clipping and ``on_before_optimizer_step``, every rank lays each gradient out as its parameter
  and averages its local gradient shards with the same rank of the live groups through its Manager, in flat buckets (one all-reduce per bucket, once per optimizer
  step, however many micro-batches it accumulates). A failed all-reduce is recorded by the Manager, which then
  discards the step on every group, as for the data-parallel communication hook;
- the heal (:meth:`ShardedSync.heal_state`, :meth:`ShardedSync.load_heal_state`): rank ``r`` of the source group
  sends the local tensors of its model and optimizer shards (DTensors do not travel: the receiver's own DTensors
  already carry the mesh and placements), and rank ``r`` of the joining group copies them in place, through the same
  path a checkpoint load takes (the mode's load template and ``apply_loaded``).

torchtitan's torchft integration averages across groups in FSDP2's all-reduce hook, once per module and micro-batch;
here it runs once per optimizer step on every parameter, so tensor-parallel modules that FSDP2 does not wrap take part
too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_ft import _compat
from lightning_ft.replica.heal_state import heal_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BUCKET_BYTES", "ShardedSync"]

BUCKET_BYTES = 64 * 1024 * 1024
"""The largest flat buffer of gradient shards averaged in one all-reduce: a bucket holds one dtype's gradients in
parameter order, so the buffer costs at most this much memory beside the gradients."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, _compat.DTensor) else tensor


def _localized(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local tensor (a view: serialized before the state changes)."""
    if isinstance(value, _compat.DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _localized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_localized(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_localized(v) for v in value)
    return value


class ShardedSync:
    """What a replica group of a sharded model does per rank (see the module docstring); one per fit and process.

    Args:
        mode: the strategy's DTensor mode (lightning_ft/strategy/parallel_modes.py): its ``strategy`` (module and
            optimizers), ``module_state_dict()`` and ``optimizer_template(optimizer)``.
        manager: this rank's torchft ``Manager``.
        bucket_bytes: the largest flat buffer averaged in one all-reduce (:data:`BUCKET_BYTES`).
    """

    def __init__(self, mode: Any, manager: Any, *, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.mode = mode
        self.manager = manager
        self.bucket_bytes = bucket_bytes

    # ------------------------------------------------------------------ the gradients

    def after_backward(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the step's last forward and backward), followed by :meth:`average_gradients`: what the
        strategy hands Lightning's precision plugin, which clips and calls ``on_before_optimizer_step`` after it."""

        def closure_then_average() -> Any:
            out = closure()
            self.average_gradients()
            return out

        return closure_then_average

    def average_gradients(self) -> None:
        """Average each local gradient shard with the same rank's of the live groups (torchft's ``Manager.allreduce``,
        an average over the quorum's participants).

        Collective across the groups: every rank of every live group calls it once per optimizer step, after the
        step's last backward, with the same parameters in the same order (the groups' modules are alike). Blocks until
        the buckets are reduced. A parameter without a gradient takes part as zeros plus a flag: it gets the average
        when some group had a gradient for it, and stays without one when none had. Never raises for a failure across
        groups: the Manager records it and discards the step; the gradients are then garbage no one applies.
        """
        model = self.mode.strategy.model
        assert model is not None
        params = [p for p in model.parameters() if p.requires_grad]
        for bucket in self._buckets(params):
            self._average_bucket(bucket)

    def _buckets(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for p in group:
                nbytes = _local(p).numel() * p.element_size()
                if bucket and size + nbytes > self.bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append(p)
                size += nbytes
            if bucket:
                yield bucket

    def _average_bucket(self, params: list[torch.Tensor]) -> None:
        for p in params:
            _align_placements(p)
        locals_ = [_local(p) for p in params]
        grads = [_local(p.grad) if p.grad is not None else None for p in params]
        like = locals_[0]
        flags = torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=like.dtype, device=like.device)
        parts = [(g if g is not None else torch.zeros_like(t)).reshape(-1) for g, t in zip(grads, locals_, strict=True)]
        flat = torch.cat([*parts, flags])
        self.manager.allreduce(flat).wait()
        if self.manager.errored() is not None:
            return  # the step is discarded on every group; leave the gradients as they are
        offset = 0
        reduced_flags = flat[-len(params) :]
        for i, (p, t) in enumerate(zip(params, locals_, strict=True)):
            n = t.numel()
            if reduced_flags[i] > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(flat[offset : offset + n].view_as(t))
            offset += n

    # ------------------------------------------------------------------ the heal

    def heal_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        """This rank's state for rank ``r`` of a joining group: :func:`~lightning_ft.replica.heal_state.heal_state`
        with the model and optimizer shards as local tensors. Called on torchft's quorum thread while the training
        thread waits for the quorum.

        Collecting a sharded optimizer's state (``get_optimizer_state_dict``) creates the state of an optimizer that
        has not stepped yet (zeros, one step counted at learning rate 0); that is undone here, so that serving a heal
        before the first step leaves this group as it was, and the joining group gets no state either."""
        optimizers = [_compat.unwrap_optimizer(opt) for opt in self.mode.strategy.optimizers]
        with _lazy_optimizer_state_kept(optimizers) as unstepped:
            state = heal_state(trainer)
        checkpoint = dict(state["checkpoint"])
        checkpoint["state_dict"] = _localized(checkpoint.get("state_dict", {}))
        saved = [_localized(s) for s in checkpoint.get("optimizer_states", [])]
        for i in unstepped:
            saved[i] = {**saved[i], "state": {}}
        checkpoint["optimizer_states"] = saved
        return {**state, "checkpoint": checkpoint}

    def load_heal_state(self, checkpoint: dict[str, Any]) -> None:
        """Copy the model and optimizer shards of ``checkpoint`` (from :meth:`heal_state` on the same rank of the
        source group) in place into this rank's DTensors, as a checkpoint load does; ``checkpoint`` then holds the
        live DTensors, for the rest of the restore. Called on the training thread, on every rank of the joining group,
        before Lightning restores the rest (the module's ``on_load_checkpoint``, schedulers, loops, callbacks).

        Raises:
            ValueError: a received shard's shape differs from this rank's (the groups' layouts differ).
        """
        mode = self.mode
        optimizers = [_compat.unwrap_optimizer(opt) for opt in mode.strategy.optimizers]
        received_optimizers = list(checkpoint.get("optimizer_states", []))
        template = {"state_dict": mode.module_state_dict()}
        _check_shapes(template["state_dict"], checkpoint["state_dict"])
        checkpoint["state_dict"] = _copy_into(template["state_dict"], checkpoint["state_dict"])
        stepped = [bool(saved.get("state")) for saved in received_optimizers]
        loaded: list[Any] = []
        for opt, saved, has_state in zip(optimizers, received_optimizers, stepped, strict=True):
            if not has_state:  # the source has not stepped: neither has this group from now on
                opt.state.clear()
                loaded.append(saved)
                continue
            own = mode.optimizer_template(opt)
            _check_shapes(own.get("state", {}), saved["state"])
            loaded.append(_copy_into(own, saved))
        checkpoint["optimizer_states"] = loaded
        _load_in_place(mode, checkpoint, optimizers, stepped)


def _align_placements(param: torch.Tensor) -> None:
    """Lay a DTensor gradient out as its parameter (tensor parallelism may leave one ``Partial`` or ``Replicate``
    where the parameter is ``Shard``): the flat buffers of all groups then hold the same elements in the same places.
    Collective inside the group when a placement changes (every rank holds the same parameters, so all take part)."""
    grad = param.grad
    if isinstance(param, _compat.DTensor) and isinstance(grad, _compat.DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


@contextmanager
def _lazy_optimizer_state_kept(optimizers: list[torch.optim.Optimizer]) -> Iterator[list[int]]:
    """Yields the indexes of the optimizers without state; on exit their state, which collecting it created, is
    dropped again (parameters are untouched: it was created at learning rate 0)."""
    unstepped = [i for i, opt in enumerate(optimizers) if not opt.state]
    try:
        yield unstepped
    finally:
        for i in unstepped:
            optimizers[i].state.clear()


def _load_in_place(
    mode: Any, checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer], stepped: list[bool]
) -> None:
    """The mode's in-place load for the stepped optimizers; an unstepped one takes only its hyperparameters."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = mode.strategy.model
    set_model_state_dict(model, checkpoint["state_dict"])
    for opt, saved, has_state in zip(optimizers, checkpoint["optimizer_states"], stepped, strict=True):
        if has_state:
            set_optimizer_state_dict(model, opt, saved)
            continue
        for group, saved_group in zip(opt.param_groups, saved.get("param_groups", []), strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})


def _copy_into(own: Any, received: Any) -> Any:
    """``received`` with each tensor copied in place into ``own``'s (its local shard for a DTensor) and ``own``'s
    tensor in its place; values ``own`` lacks are taken as received."""
    if isinstance(own, torch.Tensor):
        with torch.no_grad():
            _local(own).copy_(_local(received))
        return own
    if isinstance(own, dict) and isinstance(received, dict):
        return {k: _copy_into(own[k], v) if k in own else v for k, v in received.items()}
    if isinstance(own, (list, tuple)) and isinstance(received, (list, tuple)) and len(own) == len(received):
        return type(own)(_copy_into(o, r) for o, r in zip(own, received, strict=True))
    return received


def _check_shapes(own: Any, received: Any, where: str = "") -> None:
    if isinstance(own, torch.Tensor) and isinstance(received, torch.Tensor):
        mine = _local(own)
        if tuple(mine.shape) != tuple(received.shape):
            raise ValueError(
                f"ReplicaGroups: the shard of {where or 'a tensor'} sent to heal this rank has shape"
                f" {tuple(received.shape)}, this rank's has {tuple(mine.shape)}: every replica group must shard the model"
                " alike (the same tensor_parallel_size, data-parallel size and configure_model())"
            )
    elif isinstance(own, dict) and isinstance(received, dict):
        for key, value in own.items():
            if key in received:
                _check_shapes(value, received[key], f"{where}.{key}" if where else str(key))
