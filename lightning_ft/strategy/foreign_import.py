"""Continuing under ``ElasticFT3D`` from a checkpoint another Lightning strategy wrote.

Two kinds are imported when given as ``ckpt_path`` (or found by auto-resume):

- a Lightning ``.ckpt`` file (``DDPStrategy`` and every single-file strategy), loaded with
  :func:`~lightning_ft.checkpoint.safe_load.load_torch_file` (``weights_only=True`` plus the common Lightning classes),
  or by the user's ``CheckpointIO`` plugin where the Trainer has one (as under ``DDPStrategy``);
- a distributed checkpoint folder of ``ModelParallelStrategy`` (DCP shards plus Lightning's ``meta.pt``), read by
  :mod:`~lightning_ft.checkpoint.dcp_folder`, resharded by DCP onto this run's mesh.

For a model that is not parallelized, Lightning restores model and optimizers from the returned dict as under
``DDPStrategy``. For a DTensor-parallelized model, :func:`import_foreign_checkpoint` puts model and optimizer state into
the sharded tensors itself: each rank cuts its local shard out of a full tensor (``.ckpt``) or DCP reads the chunks
overlapping it (folder). Loops, schedulers, callbacks and the precision plugin state are restored by Lightning from
the returned dict in both cases. What such a file cannot carry is said in one warning (:func:`not_carried_over`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat
from lightning_ft.checkpoint import CheckpointError
from lightning_ft.checkpoint.internal import (
    CheckpointLocation,
    load_checkpoint_file,
    load_dcp,
    locate,
    read_lightning_dcp_meta,
)

if TYPE_CHECKING:
    from lightning_ft.events import EventLog
    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

__all__ = [
    "ForeignImport",
    "import_for_strategy",
    "import_foreign_checkpoint",
    "not_carried_over",
    "position_sampler",
    "report_import",
]


@dataclass
class ForeignImport:
    """What :func:`import_foreign_checkpoint` returns."""

    checkpoint: dict[str, Any]
    """Lightning's checkpoint dict for the rest of the restore (loops, schedulers, callbacks, ...)."""
    kind: str
    """``"Lightning .ckpt file"`` or ``"ModelParallelStrategy distributed checkpoint"``."""
    batches_into_epoch: int = 0
    """Batches per process the writer had finished in the current epoch when it saved (0 at an epoch boundary or
    when the file holds the data position itself)."""
    notes: list[str] = field(default_factory=list)


def _batches_into_epoch(checkpoint: dict[str, Any]) -> int:
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    if fit_loop.get("state_dict", {}).get("combined_loader"):
        return 0  # the writer's DataLoader was resumable: Lightning restores its position itself
    progress = fit_loop.get("epoch_loop.batch_progress", {})
    if progress.get("is_last_batch"):
        return 0
    # A save from a batch-end hook (ModelCheckpoint's every_n_train_steps) runs before the batch counts as completed:
    # processed is the number of batches whose samples were trained on.
    return int(progress.get("current", {}).get("processed", 0) or 0)


def _fill_from_full(template: dict[str, Any], full: dict[str, Any], what: str) -> None:
    missing = sorted(set(template) - set(full))
    if missing:
        raise CheckpointError(f"{what}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for key, target in template.items():
        source = full[key]
        if not isinstance(target, torch.Tensor):
            continue
        if not isinstance(source, torch.Tensor) or list(source.shape) != list(target.shape):
            got = list(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
            raise CheckpointError(f"{what}: {key!r} is {got} in the checkpoint but {list(target.shape)} in the model")
        with torch.no_grad():
            if isinstance(target, _compat.DTensor):
                target.to_local().copy_(_compat.local_shard_of_full(source.to(target.dtype), target))
            else:
                target.copy_(source)


def _rekey_optimizer_state(saved: dict[str, Any], template: dict[str, Any], index: int) -> dict[str, Any]:
    """Lightning's ``optimizer.state_dict()`` (parameters by position) keyed by parameter name as ``template``."""
    saved_groups, groups = saved.get("param_groups", []), template.get("param_groups", [])
    shape = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in groups]
    if shape[0] != shape[1]:
        raise CheckpointError(
            f"optimizer {index}: the checkpoint has parameter groups of sizes {shape[0]}, this run's optimizer"
            f" {shape[1]}; configure_optimizers() must build the same groups"
        )
    names = {
        i: name
        for g, t in zip(saved_groups, groups, strict=True)
        for i, name in zip(g["params"], t["params"], strict=True)
    }
    state = {names[i]: dict(values) for i, values in saved.get("state", {}).items() if i in names}
    for name, values in state.items():
        for key, value in values.items():
            target = template.get("state", {}).get(name, {}).get(key)
            if isinstance(target, _compat.DTensor) and isinstance(value, torch.Tensor):
                with torch.no_grad():
                    target.to_local().copy_(_compat.local_shard_of_full(value.to(target.dtype), target))
                values[key] = target
    param_groups = [{**g, "params": t["params"]} for g, t in zip(saved_groups, groups, strict=True)]
    return {"state": state, "param_groups": param_groups}


def import_foreign_checkpoint(
    location: CheckpointLocation | Path,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    parallelized: bool,
    pipelined: bool,
    weights_only: bool | None = None,
) -> ForeignImport:
    """Read the foreign checkpoint at ``location`` (a :func:`~lightning_ft.checkpoint.location.locate` result, or a
    path to locate) and, for a parallelized model, load model and optimizer state in place.

    ``model`` is the strategy's (wrapped) model; ``optimizers`` those to restore (none outside ``fit``). Every rank
    calls it; it does no communication (each rank reads what it needs).

    Raises:
        CheckpointError: the path is neither kind, the model is pipelined, the state does not fit the model, or the
            file is refused (:class:`~lightning_ft.checkpoint.UnsafeCheckpointError` names the class that blocked it).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not isinstance(location, CheckpointLocation):
        location = locate(location)
    path = location.path
    if location.ours:
        raise CheckpointError(f"ckpt_path={str(path)!r} is a lightning-ft checkpoint, not another strategy's")
    if pipelined:
        raise CheckpointError(
            f"ckpt_path={str(path)!r}: a checkpoint of another strategy cannot be imported into pipeline stages;"
            " import it with pipeline_parallel_size=1, save, and resume that checkpoint with pipeline parallelism"
        )
    optimizers = [_compat.unwrap_optimizer(opt) for opt in optimizers]
    if location.kind == "dcp_folder":
        checkpoint = read_lightning_dcp_meta(path)
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        for i, opt in enumerate(optimizers):
            _compat.init_optim_state(opt)
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt)
        load_dcp(path, state)
        set_model_state_dict(model, state["state_dict"])
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"])
        # Lightning restores a model that is not parallelized from these, as after any DDPStrategy checkpoint.
        checkpoint["state_dict"] = {k: v for k, v in state["state_dict"].items()}
        checkpoint["optimizer_states"] = [opt.state_dict() for opt in optimizers]
        kind = "ModelParallelStrategy distributed checkpoint"
    else:
        checkpoint = load_checkpoint_file(path, weights_only=weights_only)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise CheckpointError(f"ckpt_path={str(path)!r} is not a Lightning checkpoint (no 'state_dict' key)")
        kind = "Lightning .ckpt file"
        if parallelized:
            template = get_model_state_dict(model)
            _fill_from_full(template, checkpoint["state_dict"], f"ckpt_path={str(path)!r}")
            set_model_state_dict(model, template)
            saved_states = checkpoint.get("optimizer_states", [])
            if optimizers and len(saved_states) != len(optimizers):
                raise CheckpointError(
                    f"ckpt_path={str(path)!r} holds {len(saved_states)} optimizer states, this run has"
                    f" {len(optimizers)} optimizers"
                )
            for i, (opt, saved) in enumerate(zip(optimizers, saved_states, strict=False)):
                _compat.init_optim_state(opt)
                rekeyed = _rekey_optimizer_state(saved, get_optimizer_state_dict(model, opt), i)
                set_optimizer_state_dict(model, opt, rekeyed)
    return ForeignImport(checkpoint=checkpoint, kind=kind, batches_into_epoch=_batches_into_epoch(checkpoint))


def load_dcp_optimizer_states(path: Path, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Load the optimizer states of the ``ModelParallelStrategy`` folder at ``path`` in place into ``optimizers`` of
    ``model`` (the strategy's, possibly DDP-wrapped). Every rank calls it; each rank reads what it needs.

    Raises:
        CheckpointError: the folder does not hold the states of these optimizers.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizers = [_compat.unwrap_optimizer(opt) for opt in optimizers]
    state: dict[str, Any] = {}
    for i, opt in enumerate(optimizers):
        _compat.init_optim_state(opt)
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt)
    load_dcp(path, state)
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"])


def not_carried_over(imported: ForeignImport, *, fitting: bool) -> list[str]:
    """What the import could not restore, one phrase each (empty outside ``fit``: only the weights matter there)."""
    if not fitting:
        return []
    notes = [
        "random number generator states (Lightning does not save them): random streams continue from this run's seed",
        f"the world size and batch size of the run that wrote it ({imported.kind}s do not record them): the batch and"
        " learning rate are this run's, without elastic rescaling",
    ]
    if imported.batches_into_epoch:
        notes.append(
            f"the data position inside the epoch (the file records only that {imported.batches_into_epoch} batches"
            " per process were done): the epoch continues after that many batches of this run's per-process batch"
            " size and data-parallel size, exact only if the writer ran with the same sizes and Lightning's"
            " DistributedSampler"
        )
    return notes


def report_import(
    imported: ForeignImport, path: Path, *, fitting: bool, event_log: EventLog | None, trainer: Any
) -> int:
    """Log a ``resumed`` event (``fit`` only, to ``event_log`` if given: rank 0's) and warn once about what was not
    carried over. Returns the batches per process to skip in the current epoch (0 outside ``fit``)."""
    if not fitting:
        return 0
    if event_log is not None:
        event_log.write(
            "resumed",
            step=imported.checkpoint.get("global_step"),
            path=str(path),
            saved_world_size=None,
            world_size=trainer.world_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            lr_scale=1.0,
        )
    rank_zero_warn(
        f"lightning-ft: imported the {imported.kind} {path} (step {imported.checkpoint.get('global_step')}):"
        " weights, optimizer and scheduler states, loop progress and callback states carried over. Not carried"
        " over: " + "; ".join(not_carried_over(imported, fitting=fitting)) + "."
    )
    return imported.batches_into_epoch


def import_for_strategy(
    strategy: ElasticFT3D, location: CheckpointLocation, *, fitting: bool, weights_only: bool | None = None
) -> tuple[dict[str, Any], int]:
    """``ElasticFT3D.load_checkpoint`` for a checkpoint of another strategy: the checkpoint dict Lightning restores
    the rest from, and the batches per process to skip in the current epoch (:func:`position_sampler`)."""
    path = location.path
    # A model that is not parallelized is restored before the strategy's setup, as under DDPStrategy: its optimizers
    # do not exist yet. A ModelParallelStrategy folder's optimizer state is then read in place when Lightning restores
    # the optimizers (DataParallelMode.load_optimizer_state_dict); a Lightning file's is in the dict returned.
    now = fitting and strategy._parallelized
    imported = import_foreign_checkpoint(
        location,
        model=strategy.model,
        optimizers=strategy.optimizers if now else [],
        parallelized=strategy._parallelized,
        pipelined=strategy._mode.name == "pipeline",
        weights_only=weights_only,
    )
    if fitting and not now and location.kind == "dcp_folder":
        strategy._mode.foreign_optimizer_states = path
    log = strategy.event_log if strategy.global_rank == 0 else None
    trainer = strategy.lightning_module.trainer
    return imported.checkpoint, report_import(imported, path, fitting=fitting, event_log=log, trainer=trainer)


def position_sampler(trainer: Any, batches: int, *, data_parallel_size: int) -> int:
    """Advance the training sampler by ``batches`` per process, as the writer of a foreign checkpoint had.

    Call from ``on_train_start`` before the batch progress is aligned, on every rank. Returns the global samples
    skipped (0 if the loader has no resumable sampler or already holds a position).
    """
    from lightning_ft.elastic.internal import find_resumable_sampler

    loader = getattr(trainer, "train_dataloader", None)
    sampler = find_resumable_sampler(loader)
    batch_size = getattr(loader, "batch_size", None)
    if sampler is None or not batch_size or not batches or sampler.consumed:
        return 0
    samples = batches * batch_size * data_parallel_size
    sampler.mark_consumed(samples)
    return samples
