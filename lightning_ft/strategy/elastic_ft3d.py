"""``ElasticFT3D``: the Lightning strategy that composes lightning-ft's pieces.

It is a drop-in for Lightning's ``ModelParallelStrategy`` (same ``configure_model()`` contract, same mesh axis names
``"data_parallel"`` and ``"tensor_parallel"``, plus ``"pipeline_parallel"``) and behaves exactly like ``DDPStrategy``
for a module whose parameters are not DTensors after ``configure_model()``. This module holds the Lightning hooks
and the checks of the constructor's arguments; each hook delegates to the part that owns the concern (one module each
in this package, listed in docs/architecture.md).

Why one module: Lightning calls the strategy's hooks on one object, and the lifecycle table below is the one place a
reader sees the whole order of a run; splitting the hooks across modules would split that order. What a hook does
beyond delegating lives in the collaborators.

Lifecycle: the hooks that drive a collaborator, in the order Lightning calls them in ``fit``, and what each
collaborator does there (tests/strategy/test_elastic_ft3d.py holds the order). The collaborators of one run
(checkpoint I/O, auto-resume, restore order, tracker, data position, elastic resume, event log) live on one
:class:`~lightning_ft.strategy.run.StrategyRun`, which a pickled strategy drops; the fault handler (from ``fault=``)
and the parallel mode (chosen in ``_prepare``) live on the strategy.

======================  ================================================================================================
hook                    what the collaborators do
======================  ================================================================================================
``__init__``            arguments checked; fault handler built; a fresh run: auto-resume, data position, elastic resume
``setup_environment``   (every rank) torchrun world, ``ParallelConfig``, process group, mesh; event log opened; fault
                        handler installs signal handlers and watchdog hooks; checkpoint I/O opened and the loggers'
                        ``after_save_checkpoint`` patched (called once the save it announces is committed); tracker
                        built; tracker and elastic resume put first in ``trainer.callbacks``, the memory tier (when
                        on) last, after ``ModelCheckpoint``; auto-resume patches the checkpoint connector; the restore order patches
                        its restore of module and callback state (``restore_checkpoint_after_setup`` is False in every
                        mode); replica groups (fit, rank 0): a live process with this group's id makes it refuse
                        (lightning_ft/replica/duplicate_id.py)
``_prepare``            (Lightning hands that restore over, after ``configure_model``) checkpoint folders checked; the
                        parallel mode chosen (DDP, DTensor or pipeline); the memory tier's group and folder (fit,
                        collective); fault handler's start: a node in its cooldown refused, the watchdog started
                        (collective). Data parallel: the restore runs now, as under ``DDPStrategy``; DTensor or
                        pipeline: it is kept for the end of ``setup``
(connector)             auto-resume's patch picks the ``ckpt_path`` (the memory tier's agreed step when it is newer)
``load_checkpoint``     auto-resume hands over its fallbacks; checkpoint I/O loads; elastic resume told what was loaded;
                        tracker is given the RNG states, set where the resumed run reaches the point they were saved
                        at (before the training iterator, before its first fetch, or at the next batch)
(Lightning)             the module's ``on_load_checkpoint`` and weights, the datamodule's and the callbacks' state
``setup``               the mode set up (DDP wrap; or DTensor materialized or pipeline stage cut); optimizers; replica
                        groups (fit): torchft's Manager started, the torchrun agent watched, ``ModelCheckpoint``'s
                        name check answered as the writer sees it on a non-writing group, the DDP comm hook across
                        groups registered (a sharded model: its per-rank average and heal), the step gate installed (lightning_ft/replica/replica_sync.py); the
                        memory tier's budget check (fit, collective); fault handler's pre-flight health checks
                        (collective); DTensor or pipeline: the kept restore (the load, in place into the sharded
                        module and optimizers, then the rows above), still before ``on_fit_start``
(Lightning)             ``on_fit_start`` (callbacks read their restored state; ``BaseFinetuning`` re-adds its param
                        groups); then loops, optimizer state (data parallel) and LR schedulers restored
``process_dataloader``  data position swaps in the resumable sampler at the saved position
``on_train_start``      (after the callbacks': elastic resume decides accumulation and LR scale) a foreign
                        checkpoint's sampler positioned, batch progress aligned; rank 0's checkpoint I/O cleans up
                        leftovers of uncommitted saves
``batch_to_device``     replica groups (training): the quorum for the step (its first micro-batch); a joining group
                        loads the live state here; a new membership deals the rest of the epoch anew
``optimizer_step``      elastic resume applies the LR scale around the mode's optimizer step; replica groups: applied
                        only when every live group commits, else neither applied nor counted
``save_checkpoint``     elastic resume's metadata; checkpoint I/O captures the state, then writes in the background
``remove_checkpoint``   checkpoint I/O's retention (never the save in flight)
``on_exception``        the error kept for teardown
``teardown``            checkpoint I/O closed (waits for the save in flight); replica groups left; loggers' deferred
                        ``after_save_checkpoint`` calls made and their patches undone; memory tier closed (a finished fit removes its copies);
                        auto-resume and restore-order patches undone; mode torn down;
                        elastic resume writes ``resumed`` if due; ``attempt_end`` recorded; the two callbacks removed
======================  ================================================================================================

The other overrides answer Lightning's questions (``num_nodes``, ``distributed_sampler_kwargs``, the state dicts
through the mode) and hold no state of a run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ft import _compat
from lightning_ft.checkpoint import MemoryTier
from lightning_ft.checkpoint.internal import (
    format_choice,
    is_remote,
    resolve_format,
    storage_named,
    without_sampler_states,
)
from lightning_ft.elastic import ElasticPolicy
from lightning_ft.elastic.internal import DATA_RANDOMNESS, align_batch_progress, check_accumulation_scheduler
from lightning_ft.events import open_event_log
from lightning_ft.fault import FaultPolicy, checkpoint_storage
from lightning_ft.fault.internal import FaultHandler, end_attempt
from lightning_ft.parallel import ParallelConfig, build_device_mesh
from lightning_ft.parallel.internal import PIPELINE_SCHEDULES, check_positive_int
from lightning_ft.replica import ReplicaGroups
from lightning_ft.strategy import process_group
from lightning_ft.strategy.auto_resume import checkpoint_dirpaths
from lightning_ft.strategy.best_path import resolving_best
from lightning_ft.strategy.checkpoint_calls import load_for_strategy, save_for_strategy
from lightning_ft.strategy.checkpoint_io import (
    StrategyCheckpoints,
    check_checkpoint_dirpath,
)
from lightning_ft.strategy.foreign_import import position_sampler
from lightning_ft.strategy.parallel_modes import DataParallelMode, has_dtensor_parameters, mode_for
from lightning_ft.strategy.registry import register_strategy_names
from lightning_ft.strategy.run import RunPart, StrategyRun, attach_to_trainer
from lightning_ft.strategy.run_identity import mark_folders_used, mark_trained, module_identity
from lightning_ft.strategy.teardown import TeardownSteps, attached_trainer, remove_callback
from lightning_ft.strategy.torchrun_world import follow_torchrun
from lightning_ft.strategy.tracker import TrainingTracker
from lightning_ft.strategy.user_checkpoint_io import reading_through, warn_unused_writes

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


class ElasticFT3D(DDPStrategy):
    """Fault-tolerant, elastic data x tensor x pipeline parallel training for a Lightning ``Trainer``.

    Args:
        data_parallel_size: devices in one data-parallel group; ``"auto"`` = world size / (tensor x pipeline size).
        tensor_parallel_size: devices in one tensor-parallel group, kept inside a node; ``"auto"`` = devices per node.
        pipeline_parallel_size: number of pipeline stages (the outermost mesh axis, may span nodes).
        elastic: what happens when a run resumes at another world size; ``None`` refuses such a resume.
        fault: preemption, hang and health-check policy; ``None`` turns all of it off.
        auto_resume: when ``fit`` is called without ``ckpt_path``, resume from the committed checkpoint with the
            highest global step under the ``ModelCheckpoint``'s ``dirpath``.
        pipeline_schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved1f1b"``; used when ``pipeline_parallel_size > 1``.
        num_microbatches: micro-batches per pipeline step; ``None`` = 2 x pipeline size.
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None`` = the default for the device.
        timeout: timeout of the training process group.
        find_unused_parameters: passed to ``DistributedDataParallel`` when the model is not parallelized.
        checkpoint_format: ``"auto"`` (default): for plain (data-parallel: non-DTensor, non-pipeline) state at any
            process count, one ``torch.save`` file that Lightning's own loaders read (at several processes every rank
            writes its share of it in parallel); for DTensor or pipeline state, torchsnapshot folders. The choice is
            said once at set-up. ``"torchsnapshot"`` or ``"dcp"`` (PyTorch's distributed checkpoint layout): folders
            always; the commit marker, checksums, retention and fallback are the same. ``"file"``: the file only (a
            ``ValueError`` at set-up for DTensor/pipeline state). Loading recognizes every format.
        data_randomness: ``"ddp"`` (default) draws what ``DDPStrategy`` draws; ``"per_sample"`` seeds each training
            sample from its place in the epoch (exact resume with DataLoader workers, other numbers; docs/strategy.md).
        memory_tier: a :class:`~lightning_ft.MemoryTier` saves every few steps to node-local memory and a partner node,
            restored from at resume when newer than the durable checkpoints (docs/checkpointing.md, "Tiers");
            ``None`` (default): the durable tier only.
        replica_groups: a :class:`~lightning_ft.ReplicaGroups` makes this torchrun job one replica group of several,
            joined through torchft: when a group fails the others keep stepping and a replacement copies the live
            state from a healthy group (docs/replica-groups.md). ``None`` (default): one job, restarted whole.

    Raises:
        TypeError: a size is not an int (or ``"auto"`` where allowed), or a policy is of the wrong type.
        ValueError: a size is below 1, the schedule or ``data_randomness`` unknown (at construction), or the sizes do
            not multiply to the world size, or tensor parallelism would cross a node (before any process group starts).

    Example::

        trainer = L.Trainer(
            strategy=ElasticFT3D(tensor_parallel_size=2),
            callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=100, save_last=True)],
        )
        trainer.fit(model)  # resumes by itself after a crash or a restart at another world size
    """

    strategy_name = "elastic_ft3d"

    # The collaborators of one run live on ``self._run`` (a StrategyRun); these names are how the hooks reach them.
    _checkpoints = RunPart("checkpoints")
    _tracker = RunPart("tracker")
    event_log = RunPart("event_log")
    _auto_resume = RunPart("auto_resume")
    _data_position = RunPart("data_position")
    _elastic_resume = RunPart("elastic_resume")
    _memory = RunPart("memory")
    _restore_order = RunPart("restore_order")

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = 1,
        pipeline_parallel_size: int = 1,
        *,
        elastic: ElasticPolicy | None = ElasticPolicy(),  # noqa: B008 - frozen dataclass, never mutated
        fault: FaultPolicy | None = FaultPolicy(),  # noqa: B008
        auto_resume: bool = True,
        pipeline_schedule: str = "1f1b",
        num_microbatches: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        find_unused_parameters: bool = False,
        checkpoint_format: str = "auto",
        data_randomness: str = "ddp",
        memory_tier: MemoryTier | None = None,
        replica_groups: ReplicaGroups | None = None,
    ) -> None:
        if memory_tier is not None and not isinstance(memory_tier, MemoryTier):
            raise TypeError(f"ElasticFT3D(memory_tier={memory_tier!r}): must be a MemoryTier or None")
        if replica_groups is not None and not isinstance(replica_groups, ReplicaGroups):
            raise TypeError(f"ElasticFT3D(replica_groups={replica_groups!r}): must be a ReplicaGroups or None")
        if replica_groups is not None and pipeline_parallel_size != 1:
            raise ValueError(
                f"ElasticFT3D(replica_groups=..., pipeline_parallel_size={pipeline_parallel_size}): replica groups"
                " support data parallel, FSDP2 and tensor parallel inside a group, not pipeline parallel"
                " (pipeline_parallel_size=1)"
            )
        _check_arguments(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_schedule=pipeline_schedule,
            num_microbatches=num_microbatches,
            elastic=elastic,
            fault=fault,
            checkpoint_format=checkpoint_format,
            data_randomness=data_randomness,
        )
        # Replica groups: DDP must never rebuild its buckets (it does after the first iteration unless it looks for
        # unused parameters): a group that joins later would lay its gradients out in other buckets than the groups
        # it averages with, element for element (torchft's own DDP wrapper does the same).
        find_unused = find_unused_parameters or replica_groups is not None
        kwargs = {"find_unused_parameters": True} if find_unused else {}
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._pipeline_parallel_size = pipeline_parallel_size
        self.elastic = elastic
        self.fault = fault
        self.auto_resume = auto_resume
        self.checkpoint_format = checkpoint_format
        self._format_said: str | None = None  # the console line naming the format in force, once said
        self.data_randomness = data_randomness
        self.memory_tier = memory_tier
        self.replica_groups = replica_groups
        self._replica_config: Any = None  # the resolved ReplicaGroups (setup_environment)
        self._replica: Any = None  # the fit's ReplicaSync (setup .. teardown)
        self.pipeline_schedule = pipeline_schedule
        self.num_microbatches = num_microbatches
        self.parallel_config: ParallelConfig | None = None
        self._device_mesh: DeviceMesh | None = None
        self._parallelized = False
        self._mode: DataParallelMode = DataParallelMode(self)
        self._attempt_start_time = time.time()
        self._foreign_batches_into_epoch = 0
        self._fault = FaultHandler(fault) if fault is not None else None
        self._exception: BaseException | None = None
        self._prepared = False  # this stage's checks, mode and pre-flight done (_prepare)
        self._run = StrategyRun.for_strategy(self)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Not DDPStrategy's: that one would register "ddp" and its variants for this class.
        register_strategy_names(cls, strategy_registry)

    # ------------------------------------------------------------------ mesh and process groups

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        _compat.hook_launcher(self, resolving_best)  # ckpt_path="best" in a fresh process

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

    @property
    @override
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Under torchrun --nnodes=MIN:MAX the count changes at every resize; the Trainer's is kept for set_world_ranks.
        self.requested_num_nodes, self._num_nodes = num_nodes, process_group.elastic_num_nodes(num_nodes)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_config.data_parallel_size if self.parallel_config else 1

    def mesh_shape(self) -> dict[str, int]:
        """``{"pipeline_parallel": pp, "data_parallel": dp, "tensor_parallel": tp}`` of this run (outside a running
        stage: of the one process a save or load there may run in, :meth:`outside_stage_config`)."""
        cfg = self.parallel_config or self.outside_stage_config("save or load a checkpoint")
        return dict(zip(cfg.mesh_dim_names, cfg.mesh_shape, strict=True))

    def outside_stage_config(self, action: str) -> ParallelConfig:
        """The layout of a checkpoint save or load outside a running stage (``trainer.save_checkpoint`` before any
        ``fit``, Lightning's checkpoint connector called directly): no process group or device mesh exists yet, so it
        can only be a world of this one process, as with Lightning's strategies before set-up.

        Raises:
            RuntimeError: more processes were launched (torchrun's ``WORLD_SIZE``, or an initialized process group):
                every rank must save and load together, inside ``fit``/``validate``/``test``/``predict``.
            ValueError: the strategy's layout needs more than one process (``tensor_parallel_size=2``, say).
        """
        world = (
            torch.distributed.get_world_size()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "1"))
        )
        if world > 1:
            raise RuntimeError(
                f"ElasticFT3D: cannot {action} outside a running fit/validate/test/predict in a world of {world}"
                " processes: every rank takes part in each save and load, through the process group the stage sets"
                " up. Call it inside a stage (a hook, or trainer.save_checkpoint after fit) or in a one-process run."
            )
        return ParallelConfig(
            data_parallel_size=self._data_parallel_size,
            tensor_parallel_size=self._tensor_parallel_size,
            pipeline_parallel_size=self._pipeline_parallel_size,
            num_nodes=1,
            devices_per_node=1,
            owner="ElasticFT3D",
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel group's size and this rank's place in it. Before the mesh exists (Lightning prepares a
        loader outside a running stage, say), only a layout without tensor or pipeline parallelism has an answer:
        every rank is then its own data-parallel replica, as under ``DDPStrategy``."""
        if self._device_mesh is None and self._tensor_parallel_size == 1 and self._pipeline_parallel_size == 1:
            kwargs = super().distributed_sampler_kwargs
        else:
            dp_mesh = self.device_mesh["data_parallel"]
            kwargs = {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
        trainer = attached_trainer(self.lightning_module)
        # Replica groups: the training data is split over the groups (part i of num_groups until the first quorum
        # deals anew); validation, test and predict run whole in every group (lightning_ft/replica/one_model.py).
        if self._replica_config is not None and (trainer is None or trainer.training):
            size, part = kwargs["num_replicas"], self._replica_config.data_part
            kwargs = {"num_replicas": size * self._replica_config.num_groups, "rank": part * size + kwargs["rank"]}
        return kwargs

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # False in every mode, as DDPStrategy's: Lightning hands the restore of module and callback state (and the
        # stage's ckpt_path) over before setup; the run's RestoreOrder runs it there in data parallel and at the end
        # of setup for DTensor or pipeline state (loaded in place into tensors that exist only then). Either way it
        # comes before on_fit_start, where callbacks read their restored state (BaseFinetuning re-adds its groups).
        return False

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self._mode.lightning_restores_optimizer

    @override
    def set_world_ranks(self) -> None:
        # Lightning calls this once the Trainer has set devices and num_nodes; under torchrun they follow torchrun.
        changed = follow_torchrun(self)
        if changed:
            rank_zero_info(changed)
        super().set_world_ranks()

    @override
    def setup_distributed(self) -> None:
        self.set_world_ranks()
        # Validate the layout before any process group starts, so a wrong size never costs a rendezvous.
        self.parallel_config = ParallelConfig(
            data_parallel_size=self._data_parallel_size,
            tensor_parallel_size=self._tensor_parallel_size,
            pipeline_parallel_size=self._pipeline_parallel_size,
            num_nodes=self.num_nodes,
            devices_per_node=self.num_processes,
            owner="ElasticFT3D",
        )
        assert self.cluster_environment is not None
        self._process_group_backend = self._get_process_group_backend()
        process_group.init_for_this_restart(
            self.cluster_environment,
            backend=self._process_group_backend,
            global_rank=self.global_rank,
            world_size=self.world_size,
            timeout=self._timeout or default_pg_timeout,
        )
        super().setup_distributed()  # Lightning skips its own init when the group exists
        process_group.destroy_at_exit(self._process_group_backend)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.parallel_config is not None and self.lightning_module is not None
        self._device_mesh = build_device_mesh(self.parallel_config, self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh
        trainer = self.lightning_module.trainer
        if self.event_log is None:  # one attempt per process, whatever fit/validate/test calls follow
            self.event_log = open_event_log(trainer, mesh=self.mesh_shape())
        self._exception = None
        self._data_position.stage_starts()
        if self.replica_groups is not None:
            self._replica_config = self.replica_groups.resolved()  # a missing lighthouse or id: before any step
            if self._replica_config.process_group != "gloo" and self.root_device.type != "cuda":
                raise ValueError(
                    f"ReplicaGroups(process_group={self._replica_config.process_group!r}): NCCL needs a CUDA device on"
                    f" every rank, this run's is {self.root_device.type!r}; use process_group='gloo'"
                )
            if trainer.state.fn == TrainerFn.FITTING and self.global_rank == 0:
                # Before auto-resume looks at the folders and before this group heartbeats: a live process with this
                # id (a second launch, a killed torchrun's worker) makes this one refuse (replica/duplicate_id.py).
                from lightning_ft.replica.internal import refuse_a_live_duplicate

                config = self._replica_config
                refuse_a_live_duplicate(
                    config.lighthouse,
                    config.replica_id,
                    timeout=config.timeout,
                    connect_timeout_s=config.connect_timeout.total_seconds(),
                )
        if self._fault is not None:
            self._fault.install(trainer, self.event_log)  # fit only: signal handlers, watchdog hooks
        self._checkpoint_manager().open(storage=checkpoint_storage(trainer))
        self._checkpoint_manager().defer_logger_calls(trainer.loggers)
        if self._tracker is None:
            self._tracker = TrainingTracker(
                event_log=lambda: self.event_log,
                checkpoints=self._checkpoint_manager(),
                data_position=self._data_position,
                attempt_start_time=self._attempt_start_time,
            )
        # The strategy records progress (before any callback's setup can claim it), timed by its tracker; a
        # GoodputMonitor logs that same timer's totals, so its goodput/* tags and the report agree.
        self.event_log.claim("progress", timer=self._tracker.timer)
        if self._fault is not None:  # a hang ends the process from the watchdog's thread: the steps so far first
            self._fault.before_hang_exit = lambda: self._tracker.write_pending(trainer) if self._tracker else None
        # The memory tier saves after every other callback's on_train_batch_end, as ModelCheckpoint does (last): a
        # memory copy of step N holds what a durable checkpoint of step N holds (a callback's count of that batch).
        attach_to_trainer(
            trainer,
            callbacks=[self._tracker, self._elastic_resume],
            run_id=self.event_log.run_id,
            keep_versions=self.event_log.restarts_expected,
            last=[self._memory] if self._memory is not None else [],
            replica_id=self._replica_config.replica_id if self.replica_groups is not None else None,
        )
        self._auto_resume.install(trainer)
        self._prepared = False
        self._restore_order.install(trainer, restores_before_setup=lambda: self._prepare(trainer))

    # ------------------------------------------------------------------ model set-up and steps

    def _prepare(self, trainer: pl.Trainer) -> bool:
        """What comes before any load of the stage (once per stage, on every rank; collective): the configuration
        checks, the parallel mode chosen from the configured model, the memory tier's group, the fault handler's
        start (a node in its cooldown refused, the watchdog). Lightning hands the restore over (:class:`~lightning_ft.strategy.restore_order.RestoreOrder`)
        after ``configure_model`` and before :meth:`setup`, which prepares if that did not. Returns whether the
        mode restores module and callback state there, before ``setup``, as ``DDPStrategy`` does (data parallel)."""
        assert self.model is not None and self.parallel_config is not None
        if not self._prepared:
            if self._fault is None or not self._fault.runs_health_checks:
                for cb in trainer.checkpoint_callbacks:
                    if getattr(cb, "dirpath", None):
                        check_checkpoint_dirpath(cb.dirpath)
            check_accumulation_scheduler(trainer, self.elastic)
            self._parallelized = has_dtensor_parameters(self.model)
            self._mode = mode_for(self, self.model)
            self._checkpoint_manager().use_format(self._checkpoint_format_for_state(trainer))
            warn_unused_writes(self)
            if self._memory is not None and trainer.state.fn == TrainerFn.FITTING:
                self._memory.open_tier(trainer)  # collective: its gloo group (a resume's plan and load use it)
            if self._fault is not None:  # collective: a node in its cooldown refused; the watchdog guards the load
                self._fault.start(trainer)
            self._prepared = True
        return self._mode.name == "data_parallel"

    def _checkpoint_format_for_state(self, trainer: pl.Trainer) -> str:
        """The format this run writes: ``checkpoint_format`` resolved for the world and the state, said once on the
        console (:func:`~lightning_ft.checkpoint.internal.format_choice`). A file holds data-parallel replicas and
        DTensors whose shards are contiguous byte ranges (:mod:`~lightning_ft.checkpoint.sharded_file`); where the
        state holds anything else, ``"auto"`` writes folders and says which tensor (and placement) keeps it from a
        file, and ``"file"`` is refused naming it.

        Raises:
            ValueError: ``checkpoint_format="file"`` and the state holds a tensor a file cannot hold.
        """
        refusal = self._mode.file_refusal()
        if refusal is not None and self.checkpoint_format == "file":
            raise ValueError(
                f"ElasticFT3D(checkpoint_format='file'): {refusal}; use 'auto' (a file where the state allows it,"
                " folders otherwise), 'torchsnapshot' or 'dcp'"
            )
        plain = refusal is None
        chosen = resolve_format(self.checkpoint_format, plain=plain)
        remote = any(is_remote(d) for cb in trainer.checkpoint_callbacks if (d := getattr(cb, "dirpath", None)))
        why = refusal
        if plain and self._mode.name != "data_parallel":
            why = (
                "DTensor state whose shards are contiguous byte ranges of the saved tensors (each rank writes its own)"
            )
        choice = format_choice(self.checkpoint_format, plain=plain, world_size=self.world_size, remote=remote, why=why)
        if choice != self._format_said:  # once: a later stage of the same run says nothing new
            rank_zero_info(choice)
            self._format_said = choice
        return chosen

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._prepare(trainer)
        self._mode.setup(trainer)
        if self._replica_config is not None and trainer.state.fn == TrainerFn.FITTING:
            self._join_replica_groups(trainer)  # after the DDP wrap, before the first backward
        if self._memory is not None and trainer.state.fn == TrainerFn.FITTING:
            self._memory.setup_tier(trainer)  # collective: the budget check on every rank (optimizers exist now)
        if self._fault is not None:  # collective: health checks (all ranks start or none; they size a checkpoint)
            self._fault.preflight(trainer, check_dir=check_checkpoint_dirpath)
        self.barrier("ElasticFT3D.setup")
        self._restore_order.after_setup()  # DTensor or pipeline: the restore Lightning handed over, before on_fit_start

    def replica_live_peers(self, newest_on_disk: int | None) -> dict[str, int]:
        """Replica groups: the live groups a starting group heals from instead of reading the checkpoint on disk
        (:func:`~lightning_ft.replica.checkpoint_owner.live_peers`); empty without replica groups (auto-resume's
        hook, rank 0)."""
        if self._replica_config is None:
            return {}
        from lightning_ft.replica.internal import live_peers

        config = self._replica_config
        return live_peers(
            config.lighthouse,
            config.replica_id,
            newest_on_disk=newest_on_disk,
            timeout_s=config.connect_timeout.total_seconds(),
        )

    def _join_replica_groups(self, trainer: pl.Trainer) -> None:
        """Start this process's part in the replica groups (collective over the group; fit only)."""
        from lightning_ft.replica.internal import ReplicaSync, replica_comm_hook

        if self._mode.name not in ("data_parallel", "dtensor"):
            raise ValueError(
                f"ElasticFT3D(replica_groups=...): the {self._mode.name} mode is not supported with replica groups;"
                " data parallel, FSDP2 and tensor parallel are (pipeline_parallel_size=1)"
            )
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                "ElasticFT3D(replica_groups=...): manual optimization (automatic_optimization=False) is not supported;"
                " a step discarded across groups must be skipped by the strategy"
            )
        config, resume = self._replica_config, self._elastic_resume
        dp_mesh = self.device_mesh["data_parallel"]  # tensor-parallel ranks read the same data: the group's data ranks
        resume.use_replica_groups(
            num_groups=config.num_groups,
            num_groups_known=config.num_groups_known,
            min_replicas=config.min_replicas,
            group_size=dp_mesh.size(),
        )
        self._replica = ReplicaSync(
            config,
            trainer,
            group_rank=self.global_rank,
            group_world_size=self.world_size,
            event_log=lambda: self.event_log,
            hold_sampler=self._data_position.hold,
            membership=lambda live_groups, step, cause: resume.replica_membership(
                trainer, live_groups, step, cause=cause
            ),
            policy_state=resume.replica_state,
            load_policy_state=lambda state: resume.load_replica_state(trainer, state),
            on_heal=self._memory.superseded if self._memory is not None else lambda step: None,
            agent_pid=_torchrun_agent(),
            checkpoint_folders=lambda: [p for p in checkpoint_dirpaths(trainer) if not is_remote(str(p))],
            data_parallel=(dp_mesh.size(), dp_mesh.get_local_rank()),
        )
        if self._auto_resume.healing_from:  # the heal must reach the checkpoint left on disk
            self._replica.resume_floor = self._auto_resume.skipped_step
        if self._mode.name == "dtensor":  # each rank's shards, averaged and healed with the same rank of the others
            from lightning_ft.replica.internal import ShardedSync

            self._replica.sharded = ShardedSync(self._mode, self._replica.manager)
        else:
            self.model.register_comm_hook(self._replica.gradients, replica_comm_hook)
        self._replica.gate.install(trainer)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module.trainer if self._replica is not None and self.lightning_module else None
        if trainer is not None and trainer.training:
            # Replica groups: the quorum for the step (its first micro-batch; a joining group loads the live state
            # here), before the batch is used: at a new membership the batch in hand belongs to the old deal of the
            # epoch and is replaced by the new deal's first (lightning_ft/replica/data_deal.py).
            if self._replica.start_step():
                batch = self._replica.data.refetch(batch)
            self._replica.data.count_batch()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # The elastic learning-rate scale lives in the optimizer's own rates (what LearningRateMonitor reads).
        trainer = self.lightning_module.trainer if self.lightning_module else None
        step = trainer.global_step if trainer is not None else 0
        if self._replica is not None:  # applied only when every live group commits (replica/step_gate.py)
            if self._replica.sharded is not None:  # the shards' gradients averaged across groups, before clipping
                closure = self._replica.sharded.after_backward(closure)
            return self._replica.gate.optimizer_step(
                trainer,
                optimizer,
                lambda gated: self._elastic_resume.optimizer_step(
                    lambda: self._mode.optimizer_step(gated, closure, model, **kwargs), step
                ),
            )
        return self._elastic_resume.optimizer_step(
            lambda: self._mode.optimizer_step(optimizer, closure, model, **kwargs), step
        )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # As in ModelParallelStrategy: materialization happens in setup(), after configure_model().
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._mode.module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._mode.optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._mode.load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._mode.load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ saving

    def _checkpoint_manager(self) -> StrategyCheckpoints:
        if self._checkpoints is None:
            self._checkpoints = StrategyCheckpoints(
                global_rank=lambda: self.global_rank,
                event_log=lambda: self.event_log,
                broadcast=self.broadcast,
                all_ranks_agree=self.reduce_boolean_decision,
                checkpoint_format=self.checkpoint_format,
            )
        return self._checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _compat.PATH, storage_options: Any | None = None
    ) -> None:
        """Collective: every rank calls it (``Trainer.save_checkpoint`` does). Returns once the state is captured;
        the write and the commit continue in the background. A save Lightning routes to ``last*.ckpt`` writes
        nothing: the ``last`` link is repointed at the newest committed checkpoint instead. Outside ``fit`` (say
        ``trainer.save_checkpoint(...)`` after it returned) the save is committed before this returns.

        With ``storage_options`` the save goes to the ``CheckpointIO`` plugin instead, on rank 0, as under
        ``DDPStrategy``: what the options mean is the plugin's to say (Lightning's default ``TorchCheckpointIO``
        refuses them with a ``TypeError``). The saves in flight are committed first, so none lands after it."""
        if storage_options is not None:
            self.checkpoint_wait()
            if self.is_global_zero:
                # Lightning's own file: no loader state that only lightning-ft's loaders take, as in the file of a save
                # through lightning-ft (another strategy refuses it); a resume from it imports it.
                plain = {**checkpoint, "loops": without_sampler_states(checkpoint.get("loops", {}))}
                self.checkpoint_io.save_checkpoint(plain, filepath, storage_options=storage_options)
            return
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and "loops" in checkpoint:  # between stages, the loaders' positions are kept apart
            loops = self._data_position.loop_state_outside_stage(checkpoint["loops"], _compat.train_loaders(trainer))
            checkpoint = {**checkpoint, "loops": loops}
        if self._replica is not None and not self._replica.writes_checkpoints:
            # Replica groups: the group with the lowest id in the quorum writes it (replica/checkpoint_owner.py); its
            # path is taken from now on, as on the writer (ModelCheckpoint's version counter asks).
            self._replica.names.saved(filepath)
            return
        save_for_strategy(self, checkpoint, filepath)

    @override
    def remove_checkpoint(self, filepath: _compat.PATH) -> None:
        """Retention (``save_top_k``) goes through here. A checkpoint still being written, or the newest committed
        one, is never deleted: its removal waits until a newer checkpoint is committed. Replica groups: only the
        group that writes the checkpoints removes them."""
        if self._replica is not None and not self._replica.writes_checkpoints:
            return
        self._checkpoint_manager().remove(Path(filepath))

    def checkpoint_wait(self) -> None:
        """Block until the in-flight checkpoint is committed; re-raise a background failure. Every rank calls it."""
        if self._checkpoints is not None:
            self._checkpoints.wait()

    # ------------------------------------------------------------------ loading, resuming and the training data

    @override
    def load_checkpoint(self, checkpoint_path: _compat.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank calls it (collective). A checkpoint file is read by the ``CheckpointIO`` plugin the Trainer was
        given, where it loads its own way (``Trainer(plugins=[...])``, as ``DDPStrategy`` reads it), inside
        lightning-ft's checks (:mod:`~lightning_ft.strategy.user_checkpoint_io`)."""
        if weights_only is None:  # Lightning drops fit(..., weights_only=...) on this path; DDPStrategy's keeps it
            weights_only = _compat.stage_weights_only()
        with reading_through(self, weights_only):
            return load_for_strategy(self, checkpoint_path, weights_only=weights_only)

    def run_identity(self) -> dict[str, Any] | None:
        """The identity of this run's model that checkpoints record and auto-resume compares
        (:func:`~lightning_ft.strategy.run_identity.module_identity`; without the parameter digest for pipeline
        stages, whose parameters per rank depend on the layout)."""
        return module_identity(self.lightning_module, parameters=self._mode.name != "pipeline")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        # A resume at another data-parallel or batch size counted its batches in the old size.
        if self._foreign_batches_into_epoch:
            position_sampler(trainer, self._foreign_batches_into_epoch, data_parallel_size=self.data_parallel_size)
            self._foreign_batches_into_epoch = 0
        align_batch_progress(trainer)
        if self.global_rank == 0 and not self._auto_resume.healing_from:  # a healing group leaves the folder alone
            # Leftovers of our saves that never committed (a crash mid-write). Only now: an explicit ckpt_path naming
            # one has been refused with its name by then, rather than silently deleted. Never the save in flight (one
            # issued from an on_train_start hook) and never what lightning-ft did not write. Replica groups: the groups
            # share the folder, and in a whole-job restart another group may already train (min_replicas=1) and have a
            # save in flight there: only what was last modified before this process started is a leftover of the
            # failure (every writer of the previous attempt was dead by then).
            older_than = self._attempt_start_time if self._replica_config is not None else None
            self._checkpoint_manager().cleanup_leftovers(checkpoint_dirpaths(trainer), older_than=older_than)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = attached_trainer(self.lightning_module)
        return self._data_position.prepare_for(trainer, dataloader, **self.distributed_sampler_kwargs)

    # ------------------------------------------------------------------ teardown

    def __getstate__(self) -> dict[str, Any]:
        # What a run holds (the writer thread and its locks, the open event log, the tracker's callbacks) is not
        # part of the strategy's configuration: a pickled or deep-copied Trainer (or `torch.save(model)`) gets a
        # strategy that sets them up again when it runs.
        state = super().__getstate__()  # Lightning's drops its optimizer wrappers
        state.pop("_run", None)
        state["_replica"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._run = StrategyRun.for_strategy(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # DDPStrategy's: it adds its hint about unused parameters to the message
        # DDPStrategy's hook does not call the base hook that the default strategy of one device inherits; this one
        # does, so that a patch or subclass hook of Strategy.on_exception sees every failure, as it does by default.
        super(DDPStrategy, self).on_exception(exception)
        self._exception = exception  # teardown follows; it must not hide this error, and records how it ended

    @override
    def teardown(self) -> None:
        """Safe at every stage of a failed set-up: every step runs; while a run fails, their errors are logged and the
        run's own error propagates; otherwise the first error (a failed background save, say) is raised."""
        steps = TeardownSteps(failure=self._exception, rank=self.global_rank, world_size=self.world_size)
        if self._checkpoints is not None:
            checkpoints = self._checkpoints
            steps.run(
                checkpoints.close,
                "waiting for the checkpoint in flight",
                after_peer_loss=checkpoints.last_save_outcome,
            )
            steps.run(checkpoints.finish_logger_calls, "making the loggers' calls that waited for a commit")
        trainer = attached_trainer(self.lightning_module)
        if self._replica is not None:
            replica, self._replica = self._replica, None
            steps.run(replica.close, "leaving the replica groups")
        if self._memory is not None:
            fitted = self._exception is None and trainer is not None and trainer.state.fn == TrainerFn.FITTING
            steps.run(lambda: self._memory.close(finished=fitted), "closing the memory tier")
        steps.run(self._auto_resume.uninstall, "undoing the auto-resume patch")
        steps.run(self._restore_order.uninstall, "undoing the restore-order patch")
        self._prepared = False
        steps.run(self._mode.teardown, f"tearing down the {self._mode.name} mode")
        ended_by = self._exception or (steps.errors[0][1] if steps.errors else None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.global_step > 0:
            # The live model holds this fit's state (trained, or resumed): a later fit of it (or of this Trainer) in
            # this process continues from it, as under Lightning, rather than auto-resuming an older checkpoint. Not
            # after a fit that never reached a step (a failed set-up; the Tuner, which restores the initial state).
            # Nor does a later fit of a new object of the same model over these checkpoint folders.
            mark_trained(trainer, self.lightning_module)
            mark_folders_used(checkpoint_dirpaths(trainer), self.run_identity())
        if trainer is not None:
            steps.run(lambda: self._elastic_resume.finish(trainer), "recording the resume")
        steps.run(
            lambda: end_attempt(self._fault, trainer, self.event_log, ended_by, **self._elastic_resume.last_step()),
            "recording the attempt's end",
        )
        steps.run(self._data_position.stage_ended, "setting the training loaders' positions apart")
        steps.run(lambda: remove_callback(trainer, self._tracker), "removing the tracker")
        steps.run(lambda: remove_callback(trainer, self._elastic_resume), "removing the elastic resume")
        if self._memory is not None:
            steps.run(lambda: remove_callback(trainer, self._memory), "removing the memory tier")
        steps.run(super().teardown, "running DDPStrategy.teardown")
        self._exception = None  # the next run of this strategy starts clean
        steps.finish()


def _check_arguments(
    *,
    data_parallel_size: Any,
    tensor_parallel_size: Any,
    pipeline_parallel_size: Any,
    pipeline_schedule: str,
    num_microbatches: Any,
    elastic: Any,
    fault: Any,
    checkpoint_format: str,
    data_randomness: Any = "ddp",
) -> None:
    """The checks ``ElasticFT3D(...)`` runs on its arguments at construction, before any process or file exists: raise
    ``TypeError`` or ``ValueError`` naming the option, its value and the rule for the first bad argument."""
    check_positive_int("ElasticFT3D", "data_parallel_size", data_parallel_size, allow_auto=True)
    check_positive_int("ElasticFT3D", "tensor_parallel_size", tensor_parallel_size, allow_auto=True)
    check_positive_int("ElasticFT3D", "pipeline_parallel_size", pipeline_parallel_size)
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"ElasticFT3D(pipeline_schedule={pipeline_schedule!r}): must be one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if num_microbatches is not None:
        check_positive_int("ElasticFT3D", "num_microbatches", num_microbatches)
    if elastic is not None and not isinstance(elastic, ElasticPolicy):
        raise TypeError(f"ElasticFT3D(elastic={elastic!r}): must be an ElasticPolicy or None")
    if fault is not None and not isinstance(fault, FaultPolicy):
        raise TypeError(f"ElasticFT3D(fault={fault!r}): must be a FaultPolicy or None")
    storage_named(checkpoint_format, owner="ElasticFT3D")
    if data_randomness not in DATA_RANDOMNESS:
        raise ValueError(
            f"ElasticFT3D(data_randomness={data_randomness!r}): must be one of {', '.join(map(repr, DATA_RANDOMNESS))}"
            " ('ddp' draws what DDPStrategy draws; 'per_sample' seeds every training sample from its place)"
        )


def _torchrun_agent() -> int | None:
    """This worker's torchrun agent (its verified parent), or ``None`` when it is not a torchrun worker."""
    from lightning_ft.fault.internal import agent_pid

    try:
        return agent_pid()
    except RuntimeError:
        return None
