"""The three ways ``ElasticFT3D`` runs a model: plain data parallel, DTensor-parallelized, and pipelined.

The strategy picks one mode at set-up (after ``configure_model()``) and asks it everything that differs between them:
how the module is set up, how model and optimizer state are collected for a save and put back after a load, which
state is per rank, and how an optimizer step runs. Everything else in the strategy is the same for all three.

- :class:`DataParallelMode`: no parameter is a DTensor; exactly ``DDPStrategy`` (the module is wrapped in DDP).
- :class:`DTensorMode`: parameters are DTensors (tensor parallel, FSDP2); ``ModelParallelStrategy``'s flow: the module
  is materialized on the device, state dicts go through ``torch.distributed.checkpoint.state_dict``, and a checkpoint
  is loaded in place into the sharded tensors.
- :class:`PipelineMode`: ``pipeline_parallel_size > 1``; as DTensorMode, plus each rank holds one stage, whose model
  and optimizer state one data-parallel replica saves in its rank state, and which loads onto another
  data-parallel size or pipeline split (:mod:`~lightning_ft.strategy.pipeline_reshard`); gradients are averaged over
  data parallel before clipping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ft import _compat
from lightning_ft.checkpoint import CheckpointError
from lightning_ft.checkpoint.internal import file_refusal
from lightning_ft.parallel import PipelineRunner
from lightning_ft.strategy.foreign_import import load_dcp_optimizer_states
from lightning_ft.strategy.pipeline_reshard import assemble_stage, check_pipeline_resume, stage_sources, writes_stage

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_ft.strategy.elastic_ft3d import ElasticFT3D


def has_dtensor_parameters(module: torch.nn.Module) -> bool:
    return any(isinstance(p, _compat.DTensor) for p in module.parameters())


def mode_for(strategy: ElasticFT3D, model: torch.nn.Module) -> DataParallelMode:
    """The mode ``strategy`` runs ``model`` in, once ``configure_model()`` has run.

    Raises:
        ValueError: ``tensor_parallel_size > 1`` but no parameter is a DTensor.
    """
    cfg = strategy.parallel_config
    assert cfg is not None
    parallelized = has_dtensor_parameters(model)
    if not parallelized and cfg.tensor_parallel_size > 1:
        raise ValueError(
            f"ElasticFT3D(tensor_parallel_size={cfg.tensor_parallel_size}): no parameter is a DTensor after"
            " configure_model(). Parallelize the model in LightningModule.configure_model() using"
            " self.device_mesh['tensor_parallel'], or set tensor_parallel_size=1."
        )
    if cfg.pipeline_parallel_size > 1:
        return PipelineMode(strategy)
    return DTensorMode(strategy) if parallelized else DataParallelMode(strategy)


def copy_into(template: Any, saved: Any) -> Any:
    """Copy ``saved`` into the tensors of ``template`` in place (a DTensor's local shard for a DTensor) and return
    ``template`` with ``saved``'s non-tensor values. Used for state that was stored per rank as local tensors."""
    if isinstance(template, torch.Tensor):
        target = template.to_local() if isinstance(template, _compat.DTensor) else template
        with torch.no_grad():
            target.copy_(saved.to_local() if isinstance(saved, _compat.DTensor) else saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        out = dict(saved)
        for key, value in template.items():
            if key in saved:
                out[key] = copy_into(value, saved[key])
        return out
    if isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        return type(template)(copy_into(t, s) for t, s in zip(template, saved, strict=True))
    return saved


def _refuse_pipeline_checkpoint(path: Any, metadata: dict[str, Any], mesh: dict[str, int]) -> None:
    saved_mesh = metadata.get("mesh") or {}
    if int(saved_mesh.get("pipeline_parallel", 1)) > 1:
        check_pipeline_resume(path, saved_mesh, mesh)


class DataParallelMode:
    """Plain data parallel: exactly what ``DDPStrategy`` does."""

    name = "data_parallel"
    lightning_restores_optimizer = True
    """Lightning loads the optimizer state from the checkpoint dict (nothing was loaded in place)."""

    def __init__(self, strategy: ElasticFT3D) -> None:
        self.strategy = strategy
        self.foreign_optimizer_states: Any = None
        """A ``ModelParallelStrategy`` folder imported before set-up, whose optimizer state is read when Lightning
        restores the optimizers (they do not exist before)."""

    def setup(self, trainer: pl.Trainer) -> None:
        DDPStrategy.setup(self.strategy, trainer)  # wraps the module in DistributedDataParallel

    def module_state_dict(self) -> dict[str, Any]:
        return DDPStrategy.lightning_module_state_dict(self.strategy)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _compat.unwrap_optimizer(optimizer).state_dict()

    def load_model_state_dict(self, checkpoint: Any, strict: bool) -> None:
        DDPStrategy.load_model_state_dict(self.strategy, checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        path, self.foreign_optimizer_states = self.foreign_optimizer_states, None
        if path is not None:
            load_dcp_optimizer_states(path, self.strategy.model, self.strategy.optimizers)
            return
        DDPStrategy.load_optimizer_state_dict(self.strategy, checkpoint)

    def load_template(self) -> dict[str, Any] | None:
        """The state whose tensors a load fills in place; None: load into new tensors."""
        return None

    def file_refusal(self) -> str | None:
        """Why a checkpoint file cannot hold this mode's state (one clause naming the tensor), or ``None``."""
        return None

    def move_rank_state(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Move what each rank holds differently from ``state`` into ``rank_state`` before a save."""

    def saved_rank_states(self, metadata: dict[str, Any]) -> list[int]:
        """Saved ranks (besides this rank's own) whose rank state this rank needs to load ``metadata``'s checkpoint."""
        return []

    def apply_loaded(
        self,
        path: Any,
        checkpoint: dict[str, Any],
        rank_state: dict[str, Any],
        metadata: dict[str, Any],
        saved_rank_states: dict[int, Any] | None = None,
    ) -> None:
        """Put loaded model and optimizer state into place (when Lightning does not). ``saved_rank_states``: those
        :meth:`saved_rank_states` asked for."""
        _refuse_pipeline_checkpoint(path, metadata, self.strategy.mesh_shape())

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        return DDPStrategy.optimizer_step(self.strategy, optimizer, closure, model, **kwargs)

    def teardown(self) -> None:
        pass


class DTensorMode(DataParallelMode):
    """Parameters are DTensors: ``ModelParallelStrategy``'s flow, with loads in place into the sharded tensors."""

    name = "dtensor"
    lightning_restores_optimizer = False

    def setup(self, trainer: pl.Trainer) -> None:
        strategy = self.strategy
        assert strategy.accelerator is not None and strategy.model is not None
        strategy.accelerator.setup(trainer)
        _compat.materialize_distributed_module(strategy.model, strategy.root_device)
        strategy.model = strategy.precision_plugin.convert_module(strategy.model)
        strategy.model_to_device()
        self._before_optimizers()
        strategy.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            strategy.setup_optimizers(trainer)
        strategy.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(strategy.optimizers, strategy.root_device)

    def _before_optimizers(self) -> None:
        pass

    def module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.strategy.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.strategy.model, _compat.unwrap_optimizer(optimizer))

    def load_model_state_dict(self, checkpoint: Any, strict: bool) -> None:
        pass  # loaded in place by apply_loaded

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def optimizer_template(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Optimizer state is created lazily at the first step; loading in place needs it to exist.
        _compat.init_optim_state(optimizer)
        return self.optimizer_state(optimizer)

    def file_refusal(self) -> str | None:
        """The first parameter or buffer whose shards are not contiguous byte ranges of the full tensor (optimizer
        state follows its parameter's placements), or ``None``; reads placements and shapes only."""
        model = self.strategy.model
        assert model is not None
        return file_refusal([*model.named_parameters(), *model.named_buffers()])

    def load_template(self) -> dict[str, Any] | None:
        return {
            "state_dict": self.module_state_dict(),
            "optimizer_states": [self.optimizer_template(opt) for opt in self.strategy.optimizers],
        }

    def apply_loaded(
        self,
        path: Any,
        checkpoint: dict[str, Any],
        rank_state: dict[str, Any],
        metadata: dict[str, Any],
        saved_rank_states: dict[int, Any] | None = None,
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        _refuse_pipeline_checkpoint(path, metadata, self.strategy.mesh_shape())
        model = self.strategy.model
        set_model_state_dict(model, checkpoint["state_dict"])
        if not self.strategy.optimizers:
            return  # validate/test/predict: no optimizers to restore
        for opt, opt_state in zip(self.strategy.optimizers, checkpoint.get("optimizer_states", []), strict=True):
            set_optimizer_state_dict(model, opt, opt_state)


class PipelineMode(DTensorMode):
    """Pipeline parallel: this rank holds one stage (two with ``interleaved1f1b``) of the module."""

    name = "pipeline"

    def __init__(self, strategy: ElasticFT3D) -> None:
        super().__init__(strategy)
        self.runner: PipelineRunner | None = None
        self._clip_patch: _compat.Patch | None = None

    def _before_optimizers(self) -> None:
        """Cut the module into this rank's stage before optimizers exist, so they see only the stage's parameters,
        and route gradient clipping through the runner, which knows every stage's norm."""
        strategy = self.strategy
        cfg = strategy.parallel_config
        assert cfg is not None and strategy.lightning_module is not None
        pp = cfg.pipeline_parallel_size
        self.runner = runner = PipelineRunner(
            strategy.lightning_module,
            group=strategy.device_mesh["pipeline_parallel"].get_group(),
            num_microbatches=strategy.num_microbatches or 2 * pp,
            schedule=strategy.pipeline_schedule,
            stages_per_rank=2 if strategy.pipeline_schedule == "interleaved1f1b" else 1,
            device=strategy.root_device,
        )
        self._clip_patch = _compat.Patch(
            strategy.precision_plugin,
            "clip_grad_by_norm",
            lambda optimizer, clip_val: runner.clip_grad_norm_(clip_val),
            name="pipeline gradient clipping across stages",
        ).install()

    def load_template(self) -> dict[str, Any] | None:
        return {}  # stage state travels in rank_state and is copied in place by apply_loaded

    def file_refusal(self) -> str | None:
        pp = self.strategy.parallel_config.pipeline_parallel_size if self.strategy.parallel_config else 0
        return (
            f"pipeline_parallel_size={pp}: each rank holds one pipeline stage, whose state its data-parallel replica 0"
            " keeps in its rank state (a checkpoint file holds data-parallel replicas and Replicate/Shard(0) DTensors)"
        )

    def move_rank_state(self, state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        # Each stage holds other parameters, so model and optimizer state go with a rank that owns them: the stage's
        # data-parallel replica 0 writes it, the other replicas (identical after gradient averaging) write nothing.
        stage = {k: state.pop(k) for k in ("state_dict", "optimizer_states") if k in state}
        if writes_stage(self.strategy.device_mesh["data_parallel"].get_local_rank()):
            rank_state["stage"] = stage

    def saved_rank_states(self, metadata: dict[str, Any]) -> list[int]:
        saved_mesh = metadata.get("mesh") or {}
        if int(saved_mesh.get("pipeline_parallel", 1)) < 2:
            return []
        tp_index = self.strategy.device_mesh["tensor_parallel"].get_local_rank()
        if int(saved_mesh.get("tensor_parallel", 1)) != self.strategy.mesh_shape()["tensor_parallel"]:
            return []  # refused in apply_loaded, with the reason
        return stage_sources(saved_mesh, tp_index)

    def apply_loaded(
        self,
        path: Any,
        checkpoint: dict[str, Any],
        rank_state: dict[str, Any],
        metadata: dict[str, Any],
        saved_rank_states: dict[int, Any] | None = None,
    ) -> None:
        strategy = self.strategy
        check_pipeline_resume(path, metadata.get("mesh"), strategy.mesh_shape())
        sources = saved_rank_states or {}
        stages = [sources[r].get("stage") for r in sorted(sources)]
        if any(stage is None for stage in stages):
            raise CheckpointError(f"checkpoint {path}: a pipeline stage's state is missing from its rank state")
        templates = [self.optimizer_template(opt) for opt in strategy.optimizers]
        model_template = self.module_state_dict()
        model_state, optimizer_states = assemble_stage(
            path, stages, model_template=model_template, optimizer_templates=templates
        )
        checkpoint["state_dict"] = copy_into(model_template, model_state)
        checkpoint["optimizer_states"] = [
            copy_into(template, saved)
            for template, saved in zip(templates, optimizer_states, strict=bool(strategy.optimizers))
        ]
        super().apply_loaded(path, checkpoint, rank_state, metadata)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        runner = self.runner
        assert runner is not None
        dp_group = self.strategy.device_mesh["data_parallel"].get_group()

        def closure_then_average() -> Any:
            # After backward, before Lightning's clipping: stage gradients are averaged over data parallel here,
            # since pipeline stages are not wrapped in DDP or FSDP.
            out = closure()
            runner.sync_data_parallel_grads(dp_group)
            return out

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def teardown(self) -> None:
        if self._clip_patch is not None:
            self._clip_patch.undo()
            self._clip_patch = None
        if self.runner is not None:
            self.runner.detach()
            self.runner = None
