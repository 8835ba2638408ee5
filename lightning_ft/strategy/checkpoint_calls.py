"""``ElasticFT3D.save_checkpoint`` and ``load_checkpoint``.

:func:`save_for_strategy` splits Lightning's checkpoint dict into the shared state, each rank's own state and the
run's metadata, and hands them to the background writer. :func:`load_for_strategy` decides which reader a path needs
and what a load means for ``fit`` and for evaluation:

- A path lightning-ft did not write (a Lightning ``.ckpt`` file, a ``ModelParallelStrategy`` folder) is imported
  (:mod:`~lightning_ft.strategy.foreign_import`).
- The memory tier's agreed step (``ElasticFT3D(memory_tier=...)``, chosen by auto-resume) is restored by the tier,
  each rank from its own node or from the partner that keeps its copy; if that fails on any rank, every rank falls back
  to the durable candidates (a ``checkpoint_rejected`` line names the tier).
- A lightning-ft checkpoint is read with fallback to older committed ones (:mod:`~lightning_ft.strategy.checkpoint_io`),
  each rank's own state put back (:mod:`~lightning_ft.strategy.per_rank_state`) and handed to the parallel mode.
- ``validate``/``test``/``predict`` only load weights: one line says so, nothing is resumed. ``fit`` tells the elastic
  resume what was loaded (the policy is applied at ``on_train_start``) and queues the RNG states for the tracker, which
  sets them where the saved run's random stream was in that state.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_ft.checkpoint import CheckpointError
from lightning_ft.checkpoint.internal import load_checkpoint_file
from lightning_ft.strategy import per_rank_state
from lightning_ft.strategy.checkpoint_io import run_metadata, split_checkpoint
from lightning_ft.strategy.elastic_resume import loaded_message
from lightning_ft.strategy.foreign_import import import_for_strategy
from lightning_ft.strategy.memory_checkpoints import MemoryRestoreError
from lightning_ft.strategy.run_identity import mark_folders_used

if TYPE_CHECKING:
    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D

__all__ = ["load_for_strategy", "save_for_strategy"]


def save_for_strategy(strategy: ElasticFT3D, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Start the save of Lightning's ``checkpoint`` dict to ``filepath`` (rank 0's path; every rank calls it)."""
    path = Path(strategy.broadcast(str(filepath)))
    state, rank_state = split_checkpoint(checkpoint)
    strategy._mode.move_rank_state(state, rank_state)
    module = strategy.lightning_module
    params = {name for name, _ in module.named_parameters()} if module is not None else set()
    state = per_rank_state.separate(state, rank_state, parameter_names=params)
    # A module connected to the strategy but never to a Trainer (a save before any stage) has no trainer.
    trainer = module._trainer if module is not None else None
    identity = strategy.run_identity()
    metadata = run_metadata(
        checkpoint,
        trainer=trainer,
        world_size=strategy.world_size,
        mesh=strategy.mesh_shape(),
        parallelized=strategy._parallelized,
        optimizers=strategy.optimizers,
        event_log=strategy.event_log,
        identity=identity,
        **strategy._elastic_resume.metadata(),
    )
    mark_folders_used([path.parent], identity)  # a later fit of this process does not auto-resume it
    # Everything is copied before this returns: what the user's hooks do next never reaches the checkpoint.
    volatile = frozenset(cb.state_key for cb in trainer.checkpoint_callbacks) if trainer is not None else frozenset()
    strategy._checkpoint_manager().save(path, state, rank_state, metadata, volatile_callbacks=volatile)


def load_for_strategy(
    strategy: ElasticFT3D, checkpoint_path: Any, *, weights_only: bool | None = None
) -> dict[str, Any]:
    """The checkpoint dict Lightning restores from, for ``checkpoint_path`` (every rank calls it; collective).
    ``weights_only``: Lightning's argument of ``fit/validate/test/predict`` (and of auto-resume's ``fit``), resolved as
    Lightning's ``torch.load`` resolves it (:func:`~lightning_ft.checkpoint.internal.resolve_weights_only`)."""
    if strategy.parallel_config is None:
        return _load_outside_stage(strategy, checkpoint_path, weights_only=weights_only)
    # The path was classified once, by auto-resume's choice (fit) or here (validate/test/predict reach here without
    # it); a missing path is a FileNotFoundError.
    trainer = strategy.lightning_module.trainer
    fitting = trainer.state.fn == TrainerFn.FITTING
    load_start = time.time()
    mode = strategy._mode
    memory = strategy._memory
    tier: dict[str, Any] = {}
    loaded = None
    fell_back = False
    if memory is not None and fitting and memory.planned(checkpoint_path):
        # Every rank knows the plan (agreed in auto-resume's choice); rank 0's path names it.
        candidates = strategy._auto_resume.take_candidates()
        try:
            loaded, plan = memory.load(mode.load_template())
            tier = {"tier": "peer" if plan.restored_from["peer"] else "local", "restored_from": plan.restored_from}
        except MemoryRestoreError as err:
            if not candidates:
                raise
            log = strategy.event_log
            if strategy.global_rank == 0 and log is not None:
                log.write("checkpoint_rejected", path=err.path, tier=err.tier, reason=str(err))
            rank_zero_warn(f"Skipping the memory tier: {err}. Falling back to {candidates[0].path}.")
            location, fallbacks = candidates[0], [c for c in candidates[1:] if c.ours]
            fell_back = True
    else:
        location = strategy._auto_resume.location_for(strategy.broadcast(os.fspath(checkpoint_path)))
        fallbacks = [c for c in strategy._auto_resume.take_fallbacks(location) if c.ours]
    if loaded is None:
        if not location.ours:
            checkpoint, strategy._foreign_batches_into_epoch = import_for_strategy(
                strategy, location, fitting=fitting, weights_only=weights_only
            )
            return checkpoint
        loaded = strategy._checkpoint_manager().load(
            location,
            fallbacks=fallbacks,
            template=mode.load_template(),
            rank_states=mode.saved_rank_states,
            weights_only=weights_only,
        )
        tier = {"tier": "durable", "restored_from": {"local": 0, "peer": 0, "durable": strategy.world_size}}
        if fell_back or loaded.path != location.path:
            # Lightning names the path it asked for ("Restored all states from the checkpoint at ...",
            # trainer.ckpt_path): it is told the one that was read.
            strategy._auto_resume.fell_back_to(loaded.path)
    checkpoint = _lightning_dict(loaded, world_size=strategy.world_size)
    mode.apply_loaded(
        loaded.path, checkpoint, loaded.rank_state, loaded.metadata, saved_rank_states=loaded.saved_rank_states
    )
    if not fitting:  # validate/test/predict load weights; nothing is resumed
        rank_zero_info(loaded_message(loaded.path, loaded.metadata, stage=trainer.state.fn.value))
        return checkpoint
    elastic_resume = strategy._elastic_resume
    # The policy is applied at on_train_start, once the new run's DataLoader (its batch size) is known.
    elastic_resume.checkpoint_loaded(
        loaded.path, loaded.metadata, load_start_time=load_start, load_end_time=time.time(), **tier
    )
    rng = elastic_resume.rng_states(
        loaded.rank_state.get("rng"), rank=strategy.global_rank, saved_rank=loaded.saved_rank
    )
    if strategy._tracker is not None:
        strategy._tracker.resume_with_rng(rng or None)
    return checkpoint


def _load_outside_stage(strategy: ElasticFT3D, checkpoint_path: Any, *, weights_only: bool | None) -> dict[str, Any]:
    """A load outside a running stage (Lightning's checkpoint connector called before any ``fit``/``validate``/...):
    in a world of this one process only (:meth:`ElasticFT3D.outside_stage_config`), Lightning's checkpoint dict as
    saved, checked as any load of a lightning-ft checkpoint is (commit, checksums, no unpickling), without the
    fallbacks and the resume of a stage; a checkpoint of another strategy is read as Lightning reads it."""
    strategy.outside_stage_config("load a checkpoint")
    location = strategy._auto_resume.location_for(os.fspath(checkpoint_path))
    if location.kind == "lightning_file":
        # As an import in a stage reads it: weights_only plus Lightning's types, or unrestricted as Lightning's load
        return load_checkpoint_file(location.path, weights_only=weights_only)
    if not location.ours:
        raise CheckpointError(
            f"ckpt_path={str(checkpoint_path)!r} is a distributed checkpoint of another strategy: it is imported into"
            " the model of a running stage; pass it to fit/validate/test/predict(ckpt_path=...)"
        )
    loaded = strategy._checkpoint_manager().load(location, fallbacks=[], template=None, weights_only=weights_only)
    return _lightning_dict(loaded, world_size=1)


def _lightning_dict(loaded: Any, *, world_size: int) -> dict[str, Any]:
    """Lightning's checkpoint dict from a loaded lightning-ft checkpoint: this rank's own values of the per-rank
    tensors (rank 0's on another world size) and its callback states at the top level, where Lightning keeps them."""
    same_world = loaded.metadata.get("world_size") == world_size
    checkpoint = per_rank_state.restore_own(dict(loaded.state), loaded.rank_state, same_world=same_world)
    if "callbacks" in loaded.rank_state:  # a weights-only checkpoint has none, as Lightning's has none
        checkpoint["callbacks"] = loaded.rank_state["callbacks"]
    return checkpoint
