"""``ElasticFT3D``: the Lightning strategy that composes lightning-ft's pieces.

It is a drop-in for Lightning's ``ModelParallelStrategy`` (same ``configure_model()`` contract, same mesh axis names
``"data_parallel"`` and ``"tensor_parallel"``, plus ``"pipeline_parallel"``) and behaves exactly like ``DDPStrategy``
for a module whose parameters are not DTensors after ``configure_model()``. On top of that it owns:

- the process groups and the 3-D ``DeviceMesh`` (``parallel/``),
- checkpoint I/O: every save is a torchsnapshot directory written asynchronously on a process group of its own and
  committed atomically (``checkpoint/``); ``last`` is a link repointed at the newest committed checkpoint,
- auto-resume from the newest committed checkpoint, with the elastic policy deciding batch and LR changes when the
  world size differs (``elastic/``),
- the per-rank event log (``monitors/event_log.py``).

Callbacks observe and report; the strategy is the only component that talks to process groups and storage.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ft import _state
from lightning_ft.checkpoint import AsyncCheckpointer, CheckpointError, CommitInfo, discovery, load_checkpoint
from lightning_ft.checkpoint.retention import Retention
from lightning_ft.elastic import (
    ElasticPolicy,
    ResumableSampler,
    ResumeDecision,
    align_batch_progress,
    check_accumulation_scheduler,
    plan_resume,
    swap_in_resumable_sampler,
)
from lightning_ft.fault import FaultPolicy
from lightning_ft.monitors.event_log import EventLog, next_attempt, resolve_run_id
from lightning_ft.parallel.layout import build_device_mesh
from lightning_ft.parallel.parallel_config import ParallelConfig
from lightning_ft.parallel.pipeline import PipelineRunner
from lightning_ft.training_tracker import _TrainingTracker

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

_PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b")
_LAST_NAME = re.compile(r"^last(-v?\d+)?$")


def _check_size(name: str, value: Any, allow_auto: bool) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        rule = 'a positive integer or "auto"' if allow_auto else "a positive integer"
        raise ValueError(f"ElasticFT3D({name}={value!r}): must be {rule}")


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

    Raises:
        ValueError: a size, schedule or policy is invalid (at construction), or the sizes do not multiply to the
            world size, or tensor parallelism would cross a node (before any process group starts).

    Example::

        trainer = L.Trainer(
            strategy=ElasticFT3D(tensor_parallel_size=2),
            callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=100, save_last=True)],
        )
        trainer.fit(model)  # resumes by itself after a crash or a restart at another world size
    """

    strategy_name = "elastic_ft_3d"

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
    ) -> None:
        _check_size("data_parallel_size", data_parallel_size, allow_auto=True)
        _check_size("tensor_parallel_size", tensor_parallel_size, allow_auto=True)
        _check_size("pipeline_parallel_size", pipeline_parallel_size, allow_auto=False)
        if pipeline_schedule not in _PIPELINE_SCHEDULES:
            raise ValueError(
                f"ElasticFT3D(pipeline_schedule={pipeline_schedule!r}): must be one of {', '.join(_PIPELINE_SCHEDULES)}"
            )
        if num_microbatches is not None:
            _check_size("num_microbatches", num_microbatches, allow_auto=False)
        if elastic is not None and not isinstance(elastic, ElasticPolicy):
            raise TypeError(f"ElasticFT3D(elastic={elastic!r}): must be an ElasticPolicy or None")
        if fault is not None and not isinstance(fault, FaultPolicy):
            raise TypeError(f"ElasticFT3D(fault={fault!r}): must be a FaultPolicy or None")
        kwargs = {"find_unused_parameters": True} if find_unused_parameters else {}
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self._pipeline_parallel_size = pipeline_parallel_size
        self.elastic = elastic
        self.fault = fault
        self.auto_resume = auto_resume
        self.pipeline_schedule = pipeline_schedule
        self.num_microbatches = num_microbatches
        self.parallel_config: ParallelConfig | None = None
        self.event_log: EventLog | None = None
        self._device_mesh: DeviceMesh | None = None
        self._parallelized = False
        self._pipeline: PipelineRunner | None = None
        self._checkpointer: AsyncCheckpointer | None = None
        self._tracker = _TrainingTracker(self)
        self._attempt_start_time = time.time()
        self._lock = threading.Lock()
        self._unaccounted_stall_s = 0.0
        self._retention = Retention(in_flight=lambda: self._checkpointer.in_flight if self._checkpointer else None)
        self._sampler: ResumableSampler | None = None
        self._sampler_global_batch = 1
        self._auto_candidates: list[Path] = []
        # Learning-rate factor from elastic resumes: lr_base_scale carried over from earlier resumes, times the ramp of
        # the latest decision (see _lr_factor). Applied around each optimizer step, so schedulers stay untouched.
        self._lr_base_scale = 1.0
        self._lr_decision: ResumeDecision | None = None
        self._resume_step = 0
        self._original_resume_start: Any = None

    # ------------------------------------------------------------------ mesh and process groups

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_config.data_parallel_size if self.parallel_config else 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["data_parallel"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Optimizers must exist (and DTensor-sharded) before their state can be loaded in place.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._parallelized and self._pipeline is None

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
        self._init_process_group_for_this_restart()
        super().setup_distributed()  # Lightning skips its own init when the group exists
        if self._process_group_backend != "nccl":
            # Lightning registers this for NCCL only; a gloo group left to interpreter exit can abort a process
            # whose training succeeded, which torchrun would read as a failure and restart.
            atexit.register(_destroy_dist_connection)

    def _init_process_group_for_this_restart(self) -> None:
        """Under torchrun, every restart of the group talks to the same agent store (torchrun shares its rendezvous
        TCPStore with the workers), so the process-group keys of the previous attempt are still there and gloo/NCCL
        can read a dead peer's address (pytorch #135712). Keying the group's store by the restart count isolates
        the attempts. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torchrun hands out a fresh store instead, and
        nothing needs doing."""
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart is None:
            return
        assert self.cluster_environment is not None
        timeout = self._timeout or default_pg_timeout
        store = dist.TCPStore(
            self.cluster_environment.main_address,
            self.cluster_environment.main_port,
            world_size=self.world_size,
            is_master=False,
            timeout=timeout,
        )
        prefixed = dist.PrefixStore(
            f"lightning_ft/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/restart{restart}", store
        )
        self._process_group_backend = self._get_process_group_backend()
        dist.init_process_group(
            self._process_group_backend,
            store=prefixed,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.parallel_config is not None
        self._device_mesh = build_device_mesh(self.parallel_config, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        trainer = self.lightning_module.trainer
        if self.event_log is None:  # one attempt per process, whatever fit/validate/test calls follow
            self._open_event_log(trainer)
        self._checkpointer = AsyncCheckpointer(on_commit=self._on_commit)
        trainer.callbacks.insert(0, self._tracker)
        self._keep_logger_version(trainer)
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
                rank_zero_warn(
                    "ModelCheckpoint(dirpath=None): the default path contains the logger version and changes at every"
                    " restart, so auto-resume cannot find earlier checkpoints. Set ModelCheckpoint(dirpath=...)."
                )
        self._patch_resume_start(trainer)

    def _open_event_log(self, trainer: pl.Trainer) -> None:
        root = trainer.default_root_dir
        ids: list[Any] = [None, None]
        if self.global_rank == 0:
            run_id = resolve_run_id(root)
            ids = [run_id, next_attempt(root, run_id)]
        if dist.is_initialized():
            dist.broadcast_object_list(ids, src=0)
        self.event_log = EventLog(root, rank=self.global_rank, run_id=ids[0], attempt=ids[1])
        self.event_log.bind_step(lambda: trainer.global_step if trainer.state.fn == TrainerFn.FITTING else None)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self.event_log.write(
            "attempt_start",
            step=None,
            world_size=self.world_size,
            torchrun_restart=int(restart) if restart is not None else None,
            process_start_time=_state.process_start_time(),
            mesh=self._mesh_shape(),
        )

    def _keep_logger_version(self, trainer: pl.Trainer) -> None:
        # TensorBoard's default version counts up at every launch; one run must keep one folder across restarts.
        assert self.event_log is not None
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and logger._version is None:
                logger._version = f"run_{self.event_log.run_id}"

    def _mesh_shape(self) -> dict[str, int]:
        cfg = self.parallel_config
        assert cfg is not None
        return dict(zip(cfg.mesh_dim_names, cfg.mesh_shape, strict=True))

    # ------------------------------------------------------------------ model set-up

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        self._check_checkpoint_dirs(trainer)
        check_accumulation_scheduler(trainer, self.elastic)
        self._parallelized = _state.has_dtensor_parameters(self.model)
        cfg = self.parallel_config
        assert cfg is not None
        pipelined = cfg.pipeline_parallel_size > 1
        if not self._parallelized and cfg.tensor_parallel_size > 1:
            raise ValueError(
                f"ElasticFT3D(tensor_parallel_size={cfg.tensor_parallel_size}): no parameter is a DTensor after"
                " configure_model(). Parallelize the model in LightningModule.configure_model() using"
                " self.device_mesh['tensor_parallel'], or set tensor_parallel_size=1."
            )
        if self._parallelized or pipelined:
            self._setup_parallelized(trainer)
        else:
            super().setup(trainer)  # DDPStrategy: wraps the module in DistributedDataParallel
        self.barrier("ElasticFT3D.setup")

    def _setup_parallelized(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        assert self.parallel_config is not None
        if self.parallel_config.pipeline_parallel_size > 1:
            self._setup_pipeline()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_pipeline(self) -> None:
        """Cut the module into this rank's stage (before optimizers exist, so they see only the stage's
        parameters) and route gradient clipping through the runner, which knows every stage's norm."""
        assert self.parallel_config is not None and self.lightning_module is not None
        pp = self.parallel_config.pipeline_parallel_size
        self._pipeline = PipelineRunner(
            self.lightning_module,
            group=self.device_mesh["pipeline_parallel"].get_group(),
            num_microbatches=self.num_microbatches or 2 * pp,
            schedule=self.pipeline_schedule,
            stages_per_rank=2 if self.pipeline_schedule == "interleaved1f1b" else 1,
            device=self.root_device,
        )
        runner = self._pipeline
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: runner.clip_grad_norm_(clip_val)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        factor = self._lr_factor()
        if factor == 1.0:
            return self._optimizer_step(optimizer, closure, model, **kwargs)
        # The elastic LR change multiplies the rates only for the step itself: LR schedulers keep computing the
        # unscaled schedule, and checkpoints keep unscaled rates plus the factor in their metadata.
        groups = optimizer.param_groups
        for group in groups:
            group["lr"] *= factor
        try:
            return self._optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            for group in groups:
                group["lr"] /= factor

    def _lr_factor(self) -> float:
        if self._lr_decision is None or self.lightning_module is None:
            return self._lr_base_scale
        steps = self.lightning_module.trainer.global_step - self._resume_step
        return self._lr_base_scale * self._lr_decision.lr_multiplier(steps)

    def _optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        runner, dp_group = self._pipeline, self.device_mesh["data_parallel"].get_group()

        def closure_then_average() -> Any:
            # After backward, before Lightning's clipping: stage gradients are averaged over data parallel here,
            # since pipeline stages are not wrapped in DDP or FSDP.
            out = closure()
            runner.sync_data_parallel_grads(dp_group)
            return out

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # As in ModelParallelStrategy: materialization happens in setup(), after configure_model().
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    def _checkpoint_dirpaths(self, trainer: pl.Trainer) -> list[Path]:
        return [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]

    def _check_checkpoint_dirs(self, trainer: pl.Trainer) -> None:
        for dirpath in self._checkpoint_dirpaths(trainer):
            _state.check_writable_dir(dirpath)

    # ------------------------------------------------------------------ state collection

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._parallelized and self._pipeline is None:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if not self._parallelized and self._pipeline is None:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._parallelized and self._pipeline is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # Parallelized models were loaded in place by load_checkpoint().

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._parallelized and self._pipeline is None:
            super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ saving

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Collective: every rank calls it (``Trainer.save_checkpoint`` does). Returns once the state is captured;
        the write and the commit continue in the background. A save Lightning routes to ``last*.ckpt`` writes
        nothing: the ``last`` link is repointed at the newest committed checkpoint instead. Outside ``fit`` (say
        ``trainer.save_checkpoint(...)`` after it returned) the save is committed before this returns."""
        if storage_options is not None:
            raise TypeError("ElasticFT3D.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        if _LAST_NAME.match(path.name.removesuffix(".ckpt")):
            if self.global_rank == 0:
                self._retention.request_last_link(path)
            return
        start = time.perf_counter()
        state, rank_state, metadata = self._split_checkpoint(checkpoint)
        if self._checkpointer is None:
            # No background writer outside fit: nothing would ever wait for it, so save and commit now.
            one_shot = AsyncCheckpointer(on_commit=self._on_commit)
            try:
                one_shot.save(path, state, rank_state=rank_state, metadata=metadata)
            finally:
                one_shot.close()
            return
        self._checkpointer.save(path, state, rank_state=rank_state, metadata=metadata)
        with self._lock:
            self._unaccounted_stall_s += time.perf_counter() - start

    def _split_checkpoint(self, checkpoint: dict[str, Any]) -> tuple[dict, dict, dict]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        state = {k: v for k, v in checkpoint.items() if k != "callbacks"}
        rank_state = {"callbacks": checkpoint.get("callbacks", {}), "rng": _state.collect_rng_states()}
        if self._pipeline is not None:
            # Each stage holds other parameters (and optimizer state keyed by its own parameter ids), so model and
            # optimizer go with the rank that owns them.
            rank_state["stage"] = {k: state.pop(k) for k in ("state_dict", "optimizer_states") if k in state}
        metadata = {
            "step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "world_size": self.world_size,
            "mesh": self._mesh_shape(),
            "parallelized": self._parallelized,
            "per_device_batch_size": _state.per_device_batch_size(trainer),
            "accumulate_grad_batches": trainer.accumulate_grad_batches if trainer is not None else 1,
            "base_lrs": _state.base_lrs(self.optimizers),
            "lr_scale": self._lr_factor(),
            "run_id": self.event_log.run_id if self.event_log else None,
            "attempt": self.event_log.attempt if self.event_log else None,
        }
        return state, rank_state, metadata

    def _on_commit(self, info: CommitInfo) -> None:
        """Runs on rank 0 in the checkpoint writer thread, after the commit marker is durable."""
        if self.event_log is not None:
            self.event_log.write(
                "checkpoint_committed",
                step=info.step,
                path=str(info.path),
                stall_s=info.stall_s,
                total_s=info.total_s,
                size_bytes=info.size_bytes,
            )
        self._retention.on_commit(info.path)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Retention (``save_top_k``) goes through here. A checkpoint still being written, or the newest committed
        one, is never deleted: its removal waits until a newer checkpoint is committed."""
        if self.global_rank == 0:
            self._retention.remove(Path(filepath))

    def checkpoint_wait(self) -> None:
        """Block until the in-flight checkpoint is committed; re-raise a background failure. Every rank calls it."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _take_unaccounted_stall(self) -> float:
        with self._lock:
            stall, self._unaccounted_stall_s = self._unaccounted_stall_s, 0.0
        return stall

    # ------------------------------------------------------------------ loading and auto-resume

    def _patch_resume_start(self, trainer: pl.Trainer) -> None:
        # Lightning resolves ``ckpt_path`` before any strategy code runs and loads nothing for ``None``; wrapping the
        # connector's resume_start is the one place where a strategy can choose the checkpoint itself.
        connector = trainer._checkpoint_connector
        if self._original_resume_start is not None:
            return
        original = connector.resume_start
        self._original_resume_start = (connector, original)

        def resume_start(checkpoint_path: _PATH | None = None, weights_only: bool | None = None) -> None:
            if trainer.state.fn == TrainerFn.FITTING:
                checkpoint_path = self._select_resume_path(trainer, checkpoint_path)
            original(checkpoint_path, weights_only)

        connector.resume_start = resume_start

    def _select_resume_path(self, trainer: pl.Trainer, ckpt_path: _PATH | None) -> _PATH | None:
        if ckpt_path is not None:
            return _state.resolve_explicit_ckpt_path(Path(ckpt_path))
        if not self.auto_resume:
            return None
        candidates: list[discovery.CheckpointInfo] = []
        for dirpath in self._checkpoint_dirpaths(trainer):
            candidates.extend(discovery.list_committed(dirpath))
        candidates.sort(key=lambda c: (c.step, c.mtime))
        self._auto_candidates = [c.path for c in reversed(candidates)]
        return self._auto_candidates[0] if self._auto_candidates else None

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not _state.is_lightning_ft_checkpoint(path):
            return _state.load_foreign_checkpoint(path, parallelized=self._parallelized)
        fallbacks = [p for p in self._auto_candidates if p != path]
        self._auto_candidates = []
        while True:
            try:
                loaded = self._load_everywhere(path)
                break
            except CheckpointError as err:
                if not fallbacks:
                    raise
                if self.global_rank == 0 and self.event_log is not None:
                    step = (discovery.read_metadata(path) or {}).get("step") if discovery.is_committed(path) else None
                    self.event_log.write("checkpoint_rejected", step=step, path=str(path), reason=str(err))
                rank_zero_warn(f"Skipping checkpoint {path}: {err}. Falling back to {fallbacks[0]}.")
                path = fallbacks.pop(0)
        return self._after_load(path, loaded)

    def _load_everywhere(self, path: Path) -> Any:
        """Load on every rank. ``load_checkpoint`` makes every rank raise when any rank fails; the failing rank's own
        error (a read error, say) becomes a ``CheckpointError`` too, so that all ranks fall back together."""
        template = self._parallel_template() if self._parallelized else None
        try:
            return load_checkpoint(path, template)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"checkpoint {path}: {type(err).__name__}: {err}") from err

    def _parallel_template(self) -> dict[str, Any]:
        assert self.model is not None
        if self._pipeline is not None:
            return {}  # stage state travels in rank_state and is copied in place by _after_load
        return {
            "state_dict": self.lightning_module_state_dict(),
            "optimizer_states": [self._optimizer_template(opt) for opt in self.optimizers],
        }

    def _optimizer_template(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        # Optimizer state is created lazily at the first step; loading in place needs it to exist.
        _init_optim_state(optimizer)
        return self.optimizer_state(optimizer)

    def _after_load(self, path: Path, loaded: Any) -> dict[str, Any]:
        checkpoint = dict(loaded.state)
        checkpoint["callbacks"] = loaded.rank_state.get("callbacks", {})
        if self._pipeline is not None:
            if (
                loaded.metadata.get("world_size") != self.world_size
                or loaded.metadata.get("mesh") != self._mesh_shape()
            ):
                raise CheckpointError(
                    f"checkpoint {path} was saved with mesh {loaded.metadata.get('mesh')}; with pipeline parallelism"
                    f" it can only be resumed on the same mesh, not {self._mesh_shape()}"
                )
            stage = loaded.rank_state.get("stage", {})
            checkpoint["state_dict"] = _state.copy_into(self.lightning_module_state_dict(), stage["state_dict"])
            checkpoint["optimizer_states"] = [
                _state.copy_into(self._optimizer_template(opt), saved)
                for opt, saved in zip(self.optimizers, stage.get("optimizer_states", []), strict=True)
            ]
        if self._parallelized or self._pipeline is not None:
            self._set_parallel_state(checkpoint)
        rng = loaded.rank_state.get("rng")
        if rng and loaded.metadata.get("world_size") == self.world_size:
            self._tracker.restore_rng_at_next_batch(rng)
        self._plan_elastic_resume(path, loaded.metadata)
        return checkpoint

    def _set_parallel_state(self, checkpoint: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        assert self.model is not None and self.lightning_module is not None
        set_model_state_dict(self.model, checkpoint["state_dict"])
        for opt, opt_state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=True):
            set_optimizer_state_dict(self.model, opt, opt_state)

    def _plan_elastic_resume(self, path: Path, metadata: dict[str, Any]) -> None:
        trainer = self.lightning_module.trainer
        saved_mesh = metadata.get("mesh") or {}
        saved_dp = int(saved_mesh.get("data_parallel", metadata.get("world_size", 1)))
        # The new per-device batch is the dataloader's, known only once data is set up; until the batch policy can
        # change it, it equals the saved one.
        batch = metadata.get("per_device_batch_size") or 1
        decision = plan_resume(
            self.elastic,
            saved_world_size=int(metadata.get("world_size", self.world_size)),
            saved_dp_size=saved_dp,
            saved_per_device_batch=batch,
            saved_accumulate=int(metadata.get("accumulate_grad_batches") or 1),
            new_dp_size=self.data_parallel_size,
            new_per_device_batch=batch,
            new_world_size=self.world_size,
        )
        if decision.accumulate_grad_batches != trainer.accumulate_grad_batches:
            trainer.accumulate_grad_batches = decision.accumulate_grad_batches
        self._lr_base_scale = float(metadata.get("lr_scale") or 1.0)
        self._lr_decision = decision if decision.lr_scale != 1.0 else None
        self._resume_step = int(metadata.get("step") or 0)
        if self.global_rank == 0 and self.event_log is not None:
            self.event_log.write(
                "resumed",
                step=metadata.get("step"),
                path=str(path),
                saved_world_size=metadata.get("world_size"),
                world_size=self.world_size,
                accumulate_grad_batches=decision.accumulate_grad_batches,
                lr_scale=decision.lr_scale,
            )
        rank_zero_info(f"lightning-ft: resumed from {path} (step {metadata.get('step')})")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        # A resume at another data-parallel or batch size counted its batches in the old size.
        align_batch_progress(trainer)
        if self.global_rank == 0:
            # Leftovers of saves that never committed (a crash mid-write). Only now: an explicit ckpt_path naming one
            # has been refused with its name by then, rather than silently deleted.
            for dirpath in self._checkpoint_dirpaths(trainer):
                discovery.cleanup_uncommitted(dirpath)

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        # A dataloader iterator draws its base seed from the global RNG unless it has its own generator; giving it
        # one keeps the global random stream identical between an uninterrupted and a resumed run.
        if dataloader.generator is None:
            dataloader.generator = torch.Generator().manual_seed(0)
        if not trainer.training:
            return dataloader
        # The swapped-in loader is stateful, so Lightning saves and restores its position with the loop state.
        epoch = trainer.fit_loop.epoch_progress.current.processed
        swapped = swap_in_resumable_sampler(dataloader, epoch=epoch, **self.distributed_sampler_kwargs)
        sampler = getattr(swapped, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            # The rebuilt loader keeps the generator set above; one batch consumes batch_size x dp global samples.
            self._sampler = sampler
            self._sampler_global_batch = (swapped.batch_size or 1) * self.data_parallel_size
        return swapped

    def _advance_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.mark_consumed(self._sampler_global_batch)

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        try:
            if self._checkpointer is not None:
                self._checkpointer.close()
        finally:
            self._checkpointer = None
            if self._original_resume_start is not None:
                connector, original = self._original_resume_start
                connector.resume_start = original
                self._original_resume_start = None
            if self._pipeline is not None:
                self._pipeline.detach()
                self._pipeline = None
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if trainer is not None and self._tracker in trainer.callbacks:
                trainer.callbacks.remove(self._tracker)
            super().teardown()
