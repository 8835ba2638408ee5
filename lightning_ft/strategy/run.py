"""One run of ``ElasticFT3D``: the collaborators it holds for the run, and what it attaches to the Trainer.

A strategy object outlives a run: Lightning pickles or deep-copies it with the Trainer (``torch.save(model)``, a
spawn launcher), and one strategy may serve ``fit`` then ``validate``. What belongs to one run (the checkpoint
writer with its thread and locks, the open event log, the callbacks the strategy put on the Trainer, the resume
decision, the data position) is held in one :class:`StrategyRun`, so that a pickled strategy drops one thing and
gets a fresh run when it is unpickled. The strategy's configuration, its fault handler (built from the policy) and
its parallel mode (chosen at ``setup``) stay on the strategy.

The lifecycle (which Lightning hook calls which collaborator, in order) is the table in the docstring of
:mod:`lightning_ft.strategy.elastic_ft3d`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ft import _compat
from lightning_ft.elastic.internal import TrainingDataPosition
from lightning_ft.events import checkpoint_folders, keep_logger_version, state_root
from lightning_ft.strategy.auto_resume import AutoResume
from lightning_ft.strategy.checkpoint_io import check_checkpoint_callback
from lightning_ft.strategy.elastic_resume import ElasticResume
from lightning_ft.strategy.memory_checkpoints import MemoryCheckpoints
from lightning_ft.strategy.restore_order import RestoreOrder
from lightning_ft.strategy.run_identity import state_dict_index

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.events import EventLog
    from lightning_ft.strategy.checkpoint_io import StrategyCheckpoints
    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D
    from lightning_ft.strategy.tracker import TrainingTracker

__all__ = ["RunPart", "StrategyRun", "attach_to_trainer", "keep_logger_versions"]


@dataclass
class StrategyRun:
    """The collaborators of one run of a strategy (see the module docstring). Built by :meth:`for_strategy`."""

    auto_resume: AutoResume
    """Chooses the checkpoint ``fit`` resumes from; patches the checkpoint connector from ``setup_environment`` to
    ``teardown``."""
    data_position: TrainingDataPosition
    """Where the training data stands: swaps in the resumable sampler in ``process_dataloader``, counts batches."""
    elastic_resume: ElasticResume
    """The elastic decision (a callback): told what was loaded, decides at ``on_train_start``, scales the LR."""
    checkpoints: StrategyCheckpoints | None = None
    """The checkpoint I/O (its writer thread): built on first use, opened in ``setup_environment``."""
    tracker: TrainingTracker | None = None
    """The per-batch callback (data position, RNG restore, progress events): built in ``setup_environment``."""
    event_log: EventLog | None = None
    """This attempt's event log: opened in the first ``setup_environment`` of the process."""
    memory: MemoryCheckpoints | None = None
    """The memory tier (a callback), when ``memory_tier`` is given: set up in ``setup``, closed at ``teardown``."""
    restore_order: RestoreOrder = field(default_factory=RestoreOrder)
    """When Lightning's restore of module and callback state runs: patches the checkpoint connector from
    ``setup_environment`` to ``teardown``."""

    @classmethod
    def for_strategy(cls, strategy: ElasticFT3D) -> StrategyRun:
        """A fresh run for ``strategy``: nothing opened, nothing attached yet."""
        tier = getattr(strategy, "memory_tier", None)
        memory = MemoryCheckpoints(tier, strategy) if tier is not None else None
        return cls(
            auto_resume=AutoResume(
                enabled=strategy.auto_resume,
                broadcast=strategy.broadcast,
                memory_plan=memory.plan if memory is not None else None,
                identity=strategy.run_identity,
                event_log=lambda: strategy.event_log,
                live_peers=strategy.replica_live_peers,
                memory_newest=memory.newest_own_step if memory is not None else None,
                state_index=lambda: state_dict_index(strategy.lightning_module),
            ),
            data_position=TrainingDataPosition(per_sample_seeds=strategy.data_randomness == "per_sample"),
            elastic_resume=ElasticResume.of(strategy),
            memory=memory,
        )


class RunPart:
    """A strategy attribute that lives on its run: ``strategy.<name>`` reads and sets ``strategy._run.<part>``.

    The strategy's modules keep their names for its collaborators (``strategy._tracker``, ``strategy.event_log``);
    the run holds them.
    """

    def __init__(self, part: str) -> None:
        self.part = part

    def __get__(self, strategy: Any, owner: type | None = None) -> Any:
        if strategy is None:
            return self
        return getattr(strategy._run, self.part)

    def __set__(self, strategy: Any, value: Any) -> None:
        setattr(strategy._run, self.part, value)


def attach_to_trainer(
    trainer: pl.Trainer,
    *,
    callbacks: list[Any],
    run_id: str,
    keep_versions: bool = True,
    last: list[Any] | None = None,
    replica_id: str | None = None,
) -> None:
    """Put ``callbacks`` first in ``trainer.callbacks`` (in this order; those already there stay where they are) and
    ``last`` at its end, after ``ModelCheckpoint`` (a save there captures the state every other callback's hook of the
    same batch left, as ``ModelCheckpoint``'s does; Lightning orders the callbacks before the strategy's set-up),
    keep every ``TensorBoardLogger``'s version the same across the attempts of one run, and apart for each replica
    group ``replica_id`` of a job (:func:`keep_logger_versions`), and warn about a ``ModelCheckpoint`` without a ``dirpath``.

    Raises:
        ValueError: a ``ModelCheckpoint`` option that its object-store ``dirpath`` cannot work with
            (:func:`~lightning_ft.strategy.checkpoint_io.check_checkpoint_callback`), before any step.
    """
    for position, callback in enumerate(callbacks):
        if callback not in trainer.callbacks:
            trainer.callbacks.insert(position, callback)
    for callback in last or []:
        if callback in trainer.callbacks:
            trainer.callbacks.remove(callback)
        trainer.callbacks.append(callback)
    if keep_versions:  # a plain one-process run (no restarts expected) numbers them as Lightning does
        keep_logger_versions(trainer, run_id, replica_id=replica_id)
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and getattr(cb, "dirpath", None) is None:
            rank_zero_warn(
                "ModelCheckpoint(dirpath=None): the default path contains the logger version and changes at every"
                " restart, so auto-resume cannot find earlier checkpoints. Set ModelCheckpoint(dirpath=...)."
            )
        check_checkpoint_callback(cb, world_size=trainer.world_size)


def keep_logger_versions(trainer: pl.Trainer, run_id: str, *, replica_id: str | None = None) -> None:
    """Give each ``TensorBoardLogger`` without a version the one Lightning gives it (``version_<n>``, the next free
    one) in the first attempt of the run, and the same one in every later attempt: TensorBoard's default counts up at
    every launch, and one run must keep one folder across restarts. Rank 0 chooses and records
    (:func:`~lightning_ft.events.keep_logger_version`) and broadcasts: collective, every rank calls it at set-up.

    A replica group (``replica_id``) gets ``version_<n>/group_<replica_id>``: the groups of a job log side by side,
    each in a folder of its own, under one ``version_<n>`` that the job's first group chose and recorded for the job
    (keyed by its checkpoint folders, which the groups of a job share). A group that replaces a lost one, with its id,
    continues its folder. A version the user gave the logger is theirs: every group then logs where it says."""
    # Every rank takes part in the broadcast whatever its own loggers' state, so that no rank waits alone.
    loggers = _compat.tensorboard_loggers(trainer.loggers)
    if not loggers:
        return
    versions = None
    if trainer.global_rank == 0:
        root = state_root(trainer.default_root_dir)
        key = run_id
        if replica_id is not None:
            folders = checkpoint_folders(trainer)
            key = f"replica job {json.dumps(folders)}" if folders else f"replica job of run {run_id}"
        # ``lg.version`` is Lightning's own choice: the next free version_<n> in the logger's folder.
        versions = [
            keep_logger_version(root, key, os.path.abspath(lg.root_dir), lambda lg=lg: lg.version)
            if _compat.logger_version_unset(lg)
            else None
            for lg in loggers
        ]
        if replica_id is not None:
            versions = [v if v is None else f"{_version_folder(v)}/group_{replica_id}" for v in versions]
    versions = trainer.strategy.broadcast(versions, src=0)
    for logger, version in zip(loggers, versions, strict=True):
        if version is not None:
            _compat.set_logger_version(logger, version)


def _version_folder(version: int | str) -> str:
    """The folder name Lightning's ``TensorBoardLogger`` gives ``version``."""
    return version if isinstance(version, str) else f"version_{version}"
