"""The differential scenarios: each is one Lightning user script, run as it is under ``DDPStrategy`` and ``ElasticFT3D``.

A scenario is ``fn(folder, strategy) -> observation``: it trains in ``folder`` with the strategy named ``"ddp"`` or
``"elasticft"`` (``strategy_for``; its default checkpoint format), on one process or under torchrun, and returns what a user can observe, as JSON:
paths relative to the folder, weights as ``digest``s. Every rank runs it. It starts its record with
``observation()`` and fills it as it goes, so a scenario that dies part way still reports what it saw before.
``obs["files"]`` names the paths (relative, to the module class that loads them) that a fresh process without
lightning_ft reads after the run (``_reader.py``); ``checkpoint_state`` adds a ModelCheckpoint's folder and paths.

Add a scenario with ``@scenario`` here and one line in test_scenarios.py (README.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelCheckpoint

from tests.differential.models import (
    SAFE_GLOBALS,
    AllowingCheckpointIO,
    DiffModel,
    Encoder,
    EncoderModel,
    HookOrder,
    ReplicaStateModel,
    ShuffledModel,
    TypedStateCallback,
    TypedStateModel,
    UploadViewLogger,
    digest,
)

Observation = dict[str, Any]
M = TypeVar("M")
SCENARIOS: dict[str, Callable[[Path, str], Observation]] = {}
_current: Observation = {}


def scenario(fn: Callable[[Path, str], Observation]) -> Callable[[Path, str], Observation]:
    SCENARIOS[fn.__name__] = fn
    return fn


def observation() -> Observation:
    """A fresh record for the scenario that starts; the runner keeps what it holds if the scenario raises."""
    global _current
    _current = {"files": {}}
    return _current


def current() -> Observation:
    return _current


# -- the script's pieces ---------------------------------------------------------------------------------------------


def strategy_for(name: str, elasticft: dict[str, Any] | None = None) -> Any:
    """The one line the user changes: ``DDPStrategy()`` or ``ElasticFT3D(**elasticft)`` (its own options, if any)."""
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "elasticft":
        from lightning_ft import ElasticFT3D

        return ElasticFT3D(**(elasticft or {}))
    raise ValueError(f"strategy {name!r}: 'ddp' or 'elasticft'")


def trainer(folder: Path, strategy: str, elasticft: dict[str, Any] | None = None, **kwargs: Any) -> L.Trainer:
    """A Trainer as the scripts write one: this process count, a fresh strategy object, no logger unless given."""
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy_for(strategy, elasticft),
        default_root_dir=folder / "root",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def rel(folder: Path, path: str | None) -> str | None:
    if not path:
        return path
    return Path(path).relative_to(folder).as_posix()


def checkpoint_state(obs: Observation, folder: Path, mc: ModelCheckpoint, cls: str = "DiffModel") -> Observation:
    """What the callback says (best, top k, last) and, for the reader, every entry of its folder and every path it
    names."""
    if dist.is_initialized():
        dist.barrier()  # rank 0 removes the checkpoints top-k drops; no rank lists the folder before it is done
    best_k = {rel(folder, p): float(s) for p, s in mc.best_k_models.items()}
    state = {
        "best_model_path": rel(folder, mc.best_model_path),
        "best_model_score": None if mc.best_model_score is None else float(mc.best_model_score),
        "best_k_models": dict(sorted(best_k.items())),
        "kth_best_model_path": rel(folder, mc.kth_best_model_path),
        "last_model_path": rel(folder, mc.last_model_path),
        "folder": sorted(p.name for p in Path(mc.dirpath).iterdir()) if Path(mc.dirpath).is_dir() else None,
    }
    named = [p for p in (state["best_model_path"], state["last_model_path"], *best_k) if p]
    for name in [*(rel(folder, str(Path(mc.dirpath) / n)) for n in state["folder"] or []), *named]:
        obs["files"].setdefault(name, cls)
    return state


def weights(model: L.LightningModule) -> str:
    return digest(model.state_dict())


def on_rank_zero_then_wait(fn: Callable[[], None]) -> None:
    """An edit of shared files made once, by global rank 0, as a user script does it; every rank waits for it."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        fn()
    if dist.is_initialized():
        dist.barrier()


def seeded(make: Callable[[], M]) -> M:
    """A module built from seed 0, so that both strategies start from the same weights whatever ran before."""
    L.seed_everything(0, verbose=False)
    return make()


def fit_steps(
    folder: Path,
    strategy: str,
    max_steps: int,
    callbacks: list,
    model: L.LightningModule | None = None,
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> tuple[L.Trainer, L.LightningModule]:
    """Build a seeded DiffModel (unless given) and a Trainer; seed again and fit ``max_steps``."""
    model = model if model is not None else seeded(DiffModel)
    t = trainer(folder, strategy, max_steps=max_steps, callbacks=callbacks, **kwargs)
    L.seed_everything(0, verbose=False)
    t.fit(model, ckpt_path=ckpt_path)
    return t, model


# -- ModelCheckpoint's options (Lightning's docs) ---------------------------------------------------------------------


@scenario
def version_counter(folder: Path, strategy: str) -> Observation:
    """``filename="model"`` without ``{step}``: Lightning versions the name (model.ckpt, model-v1.ckpt, ...)."""
    obs = observation()
    mc = ModelCheckpoint(
        dirpath=folder / "ckpt", filename="model", monitor="score", save_top_k=-1, every_n_train_steps=2
    )
    _, model = fit_steps(folder, strategy, 8, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def top_k_two(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", monitor="score", mode="min", save_top_k=2, every_n_train_steps=1)
    _, model = fit_steps(folder, strategy, 8, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def every_n_train_steps(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _, model = fit_steps(folder, strategy, 9, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def save_last(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=2, monitor="score", save_last=True)
    _, model = fit_steps(folder, strategy, 6, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def save_last_link(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last="link")
    _, model = fit_steps(folder, strategy, 6, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def two_checkpoint_callbacks(folder: Path, strategy: str) -> Observation:
    """Lightning's docs: one callback every few steps, one keeping the best by a metric, in their own folders."""
    obs = observation()
    every = ModelCheckpoint(dirpath=folder / "every", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    best = ModelCheckpoint(
        dirpath=folder / "best", monitor="score", save_top_k=1, save_last=True, every_n_train_steps=3
    )
    t, model = fit_steps(folder, strategy, 6, [every, best])
    obs["every"] = checkpoint_state(obs, folder, every)
    obs["best"] = checkpoint_state(obs, folder, best)
    obs["trainer.checkpoint_callback"] = "every" if t.checkpoint_callback is every else "best"
    obs["weights"] = weights(model)
    return obs


# -- loading (Lightning's docs) ---------------------------------------------------------------------------------------


@scenario
def manual_save_and_load(folder: Path, strategy: str) -> Observation:
    """``trainer.save_checkpoint`` after fit, then ``Model.load_from_checkpoint`` of it in the same script."""
    obs = observation()
    t, model = fit_steps(folder, strategy, 4, [], enable_checkpointing=False)
    obs["weights"] = weights(model)
    t.save_checkpoint(folder / "manual.ckpt")
    obs["files"]["manual.ckpt"] = "DiffModel"
    on_rank_zero_then_wait(lambda: None)
    obs["loaded"] = weights(DiffModel.load_from_checkpoint(folder / "manual.ckpt", map_location="cpu"))
    return obs


@scenario
def load_best_after_fit(folder: Path, strategy: str) -> Observation:
    """The docs' last line: ``Model.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)``, every rank."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", monitor="score", save_top_k=1, every_n_train_steps=2)
    t, model = fit_steps(folder, strategy, 6, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    best = DiffModel.load_from_checkpoint(t.checkpoint_callback.best_model_path, map_location="cpu")
    obs["best_loaded"] = weights(best)
    return obs


@scenario
def trainer_test_best(folder: Path, strategy: str) -> Observation:
    """``trainer.test(ckpt_path="best")`` after fit: the metrics of the best checkpoint's weights."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", monitor="score", save_top_k=1, every_n_train_steps=2)
    t, model = fit_steps(folder, strategy, 6, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    results = t.test(model, ckpt_path="best", verbose=False)
    obs["test"] = [{k: float(v) for k, v in r.items()} for r in results]
    obs["tested_path"] = rel(folder, t.ckpt_path)
    obs["weights_after_test"] = weights(model)
    return obs


@scenario
def logger_upload_view(folder: Path, strategy: str) -> Observation:
    """A logger that uploads every checkpoint (``log_model="all"``): what it finds at each ``after_save_checkpoint``."""
    obs = observation()
    logger = UploadViewLogger(folder)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", monitor="score", save_top_k=2, every_n_train_steps=2)
    _, model = fit_steps(folder, strategy, 6, [mc], logger=logger)
    obs["uploads_per_save"] = logger.calls
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def logger_upload_every_save(folder: Path, strategy: str) -> Observation:
    """``WandbLogger(log_model="all")`` with ``save_top_k=-1`` and no monitor: every save is uploaded at its call."""
    obs = observation()
    logger = UploadViewLogger(folder)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _, model = fit_steps(folder, strategy, 8, [mc], logger=logger)
    obs["uploads_per_save"] = logger.calls
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def logger_upload_with_last(folder: Path, strategy: str) -> Observation:
    """An uploading logger with ``save_last=True``: the top-k save's call sees ``last.ckpt`` as the previous step left
    it; the ``last`` save's own call sees the new one."""
    obs = observation()
    logger = UploadViewLogger(folder)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", monitor="score", save_top_k=2, every_n_train_steps=2, save_last=True)
    _, model = fit_steps(folder, strategy, 8, [mc], logger=logger)
    obs["uploads_per_save"] = logger.calls
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def logger_upload_with_last_link(folder: Path, strategy: str) -> Observation:
    """An uploading logger with ``save_last="link"``: each save's call sees ``last.ckpt`` still pointing at the
    previous save (Lightning moves the link right after the call)."""
    obs = observation()
    logger = UploadViewLogger(folder)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last="link")
    _, model = fit_steps(folder, strategy, 8, [mc], logger=logger)
    obs["uploads_per_save"] = logger.calls
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


# -- a user's edits of a checkpoint -----------------------------------------------------------------------------------


def _edit(src: Path, dst: Path) -> None:
    """Checkpoint surgery before fine-tuning: zero the head, change a hyperparameter, save under a new name."""
    ckpt = torch.load(src, map_location="cpu")
    ckpt["state_dict"]["head.weight"] = torch.zeros_like(ckpt["state_dict"]["head.weight"])
    ckpt["hyper_parameters"]["lr"] = 0.01
    torch.save(ckpt, dst)


@scenario
def surgery_on_a_copy(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc])
    on_rank_zero_then_wait(lambda: _edit(folder / "ckpt" / "step=4.ckpt", folder / "edited.ckpt"))
    obs["files"]["edited.ckpt"] = "DiffModel"
    loaded = DiffModel.load_from_checkpoint(folder / "edited.ckpt", map_location="cpu")
    obs["loaded"] = {"weights": weights(loaded), "lr": loaded.hparams.lr}
    _, model = fit_steps(folder, strategy, 6, [], enable_checkpointing=False, ckpt_path=folder / "edited.ckpt")
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs


@scenario
def surgery_in_place(folder: Path, strategy: str) -> Observation:
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc])
    path = folder / "ckpt" / "step=4.ckpt"
    on_rank_zero_then_wait(lambda: _edit(path, path))
    _, model = fit_steps(folder, strategy, 6, [], enable_checkpointing=False, ckpt_path=path)
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs


def _edit_replica_state(src: Path, dst: Path) -> None:
    """The edits users make to a checkpoint of a model whose replicas differ: BatchNorm statistics, a memory bank and a
    weight, saved under a new name."""
    ckpt = torch.load(src, map_location="cpu")
    state = ckpt["state_dict"]
    state["backbone.1.running_mean"] = torch.full_like(state["backbone.1.running_mean"], 5.0)
    state["bank"] = torch.full_like(state["bank"], 7.0)
    state["head.weight"] = torch.full_like(state["head.weight"], 0.25)
    torch.save(ckpt, dst)


@scenario
def edited_replica_state(folder: Path, strategy: str) -> Observation:
    """Edits of tensors whose replicas differ between ranks (BatchNorm statistics, a memory bank) reach every rank at
    ``validate(ckpt_path=...)`` and ``fit(ckpt_path=...)``, with the module versions of ``state_dict._metadata``."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc], model=seeded(ReplicaStateModel), limit_val_batches=0)
    obs["files"]["ckpt/step=4.ckpt"] = "ReplicaStateModel"
    on_rank_zero_then_wait(lambda: _edit_replica_state(folder / "ckpt" / "step=4.ckpt", folder / "edited.ckpt"))
    obs["files"]["edited.ckpt"] = "ReplicaStateModel"
    model = seeded(ReplicaStateModel)
    trainer(folder, strategy, enable_checkpointing=False).validate(model, ckpt_path=folder / "edited.ckpt")
    obs["validate"] = {
        "start": model.validation_start,
        "state_dict_type": model.loaded_state_dict_type,
        "norm_versions": model.backbone[1].versions_seen,
    }
    model = seeded(ReplicaStateModel)
    _, model = fit_steps(
        folder,
        strategy,
        6,
        [],
        model=model,
        enable_checkpointing=False,
        limit_val_batches=0,
        ckpt_path=folder / "edited.ckpt",
    )
    obs["resumed"] = {
        "start_step": model.fit_start_step,
        "start_weights": model.train_start_weights,
        "state_dict_type": model.loaded_state_dict_type,
        "norm_versions": model.backbone[1].versions_seen,
    }
    obs["weights"] = weights(model)
    return obs


@scenario
def weights_only_files(folder: Path, strategy: str) -> Observation:
    """``ModelCheckpoint(save_weights_only=True)``: the files hold the weights and the loop's counters, no callbacks."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=-1, save_weights_only=True)
    _, model = fit_steps(folder, strategy, 4, [mc])
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


def _slim(path: Path) -> None:
    """Slim a checkpoint for deployment the ordinary way: keep the weights and hyperparameters, save in place."""
    ckpt = torch.load(path, map_location="cpu")
    torch.save({"state_dict": ckpt["state_dict"], "hyper_parameters": ckpt["hyper_parameters"]}, path)


@scenario
def slim_last_then_resume(folder: Path, strategy: str) -> Observation:
    """Slimming last.ckpt must not change the step checkpoint; the next fit resumes that one in full."""
    obs = observation()
    mc = ModelCheckpoint(
        dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, save_last=True, filename="{step}"
    )
    fit_steps(folder, strategy, 8, [mc])
    on_rank_zero_then_wait(lambda: _slim(folder / "ckpt" / "last.ckpt"))
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    _, model = fit_steps(
        folder, strategy, 10, [], enable_checkpointing=False, ckpt_path=folder / "ckpt" / "step=8.ckpt"
    )
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs


# -- what a load admits and returns ------------------------------------------------------------------------------------


@scenario
def resume_with_weights_only_false(folder: Path, strategy: str) -> Observation:
    """An object in the hyperparameters that torch's allowlist lacks: resume with ``fit(..., weights_only=False)``."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc], model=seeded(lambda: EncoderModel(encoder=Encoder(["a", "b"]))))
    obs["files"]["ckpt/step=4.ckpt"] = "EncoderModel"
    model = seeded(lambda: EncoderModel(encoder=Encoder(["a", "b"])))
    t = trainer(folder, strategy, max_steps=6, enable_checkpointing=False)
    L.seed_everything(0, verbose=False)
    t.fit(model, ckpt_path=folder / "ckpt" / "step=4.ckpt", weights_only=False)
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs


@scenario
def resume_through_user_checkpoint_io(folder: Path, strategy: str) -> Observation:
    """``Trainer(plugins=[CheckpointIO])`` whose ``load_checkpoint`` allows the classes the checkpoint holds (darts'
    plugin does): the resume reads the file through it, with ``weights_only`` as Lightning gives it."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    model = seeded(lambda: EncoderModel(encoder=Encoder(["a", "b"])))
    fit_steps(folder, strategy, 4, [mc], model=model, plugins=[AllowingCheckpointIO([Encoder])])
    plugin = AllowingCheckpointIO([Encoder])
    model = seeded(lambda: EncoderModel(encoder=Encoder(["a", "b"])))
    fit_steps(
        folder,
        strategy,
        6,
        [],
        model=model,
        ckpt_path=folder / "ckpt" / "step=4.ckpt",
        enable_checkpointing=False,
        plugins=[plugin],
    )
    obs["plugin_loads"] = [(rel(folder, path), weights_only) for path, weights_only in plugin.calls]
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["encoder"] = repr(model.hparams.encoder)
    obs["weights"] = weights(model)
    return obs


@scenario
def resume_with_another_seed(folder: Path, strategy: str) -> Observation:
    """Issue 37 (6): a shuffled run saved at the end of epoch 0 with seed 0 is resumed after ``seed_everything(2)``:
    it resumes, and epoch 1's order follows seed 2, as DDPStrategy's sampler does."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc], model=seeded(ShuffledModel))
    model = seeded(ShuffledModel)
    t = trainer(folder, strategy, max_steps=8, enable_checkpointing=False)
    L.seed_everything(2, verbose=False)
    t.fit(model, ckpt_path=folder / "ckpt" / "step=4.ckpt")
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["step"] = t.global_step
    obs["weights"] = weights(model)
    return obs


@scenario
def restored_types(folder: Path, strategy: str) -> Observation:
    """A Counter, an OrderedDict and a frozenset in a callback's state, a namedtuple saved by the module, all allowed
    with ``torch.serialization.add_safe_globals``: after resume, each comes back as its own type."""
    obs = observation()
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc, TypedStateCallback()], model=seeded(TypedStateModel))
    obs["files"]["ckpt/step=4.ckpt"] = "TypedStateModel"
    callback = TypedStateCallback()
    _, model = fit_steps(
        folder,
        strategy,
        6,
        [callback],
        model=seeded(TypedStateModel),
        enable_checkpointing=False,
        ckpt_path=folder / "ckpt" / "step=4.ckpt",
    )
    obs["types"] = {
        "counts": type(callback.counts).__name__,
        "order": type(callback.order).__name__,
        "tags": type(callback.tags).__name__,
        "pair": type(model.loaded_pair).__name__,
    }
    obs["state"] = {"counts": dict(callback.counts), "order": list(callback.order), "tags": sorted(callback.tags)}
    obs["weights"] = weights(model)
    return obs


# -- when a fit resumes (issue 30) ------------------------------------------------------------------------------------


@scenario
def second_fit_same_trainer(folder: Path, strategy: str) -> Observation:
    """Issue 30 A: raise ``max_steps`` on the same Trainer and fit again: Lightning continues from the live state."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    t, model = fit_steps(folder, strategy, 10, [mc])
    obs["first"] = {"step": t.global_step, "weights": weights(model)}
    t.fit_loop.epoch_loop.max_steps = 14
    t.fit(model)
    obs["second"] = {
        "start_step": model.fit_start_step,
        "start_weights": model.train_start_weights,
        "step": t.global_step,
    }
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


@scenario
def new_trainer_on_trained_model(folder: Path, strategy: str) -> Observation:
    """Issue 30 B: stage 2 is a new Trainer on the trained model, same checkpoint folder: it trains from the live
    weights."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    t, model = fit_steps(folder, strategy, 12, [mc])
    obs["stage1"] = weights(model)
    stage2 = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="stage2-{step}")
    t2 = trainer(folder, strategy, max_steps=6, callbacks=[stage2])
    t2.fit(model)
    obs["stage2"] = {
        "start_step": model.fit_start_step,
        "start_weights": model.train_start_weights,
        "step": t2.global_step,
    }
    obs["checkpoint"] = checkpoint_state(obs, folder, stage2)
    obs["weights"] = weights(model)
    return obs


class _Crash(Exception):
    pass


class _CrashAfter(Callback):
    """The user's code fails after a given step (an exception in a hook, as a bug or a bad batch raises one)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise _Crash(f"step {self.step}")


@scenario
def other_experiment_same_root(folder: Path, strategy: str) -> Observation:
    """Issue 30 C: experiment A (memory tier every 2 steps under ElasticFT3D) fails at step 5; experiment B starts from
    the same working folder with a new, empty checkpoint folder and another learning rate: it trains from scratch."""
    obs = observation()
    tier = None
    if strategy == "elasticft":  # the oracle's process never imports lightning_ft
        from lightning_ft import MemoryTier

        tier = {"memory_tier": MemoryTier(every_n_train_steps=2, dirpath=folder / "node-memory")}
    a = ModelCheckpoint(dirpath=folder / "ckpt-a", every_n_train_steps=4, save_top_k=-1)
    model = seeded(DiffModel)
    t = trainer(folder, strategy, elasticft=tier, max_steps=8, callbacks=[a, _CrashAfter(5)])
    try:
        t.fit(model)
    except _Crash:
        obs["a"] = "failed at step 5"
    b = ModelCheckpoint(dirpath=folder / "ckpt-b", every_n_train_steps=4, save_top_k=-1)
    t, model = fit_steps(folder, strategy, 6, [b], model=seeded(lambda: DiffModel(lr=0.01)), elasticft=tier)
    obs["b"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights, "step": t.global_step}
    obs["checkpoint"] = checkpoint_state(obs, folder, b)
    obs["weights"] = weights(model)
    return obs


@scenario
def wider_layer_same_folder(folder: Path, strategy: str) -> Observation:
    """Issue 30 D: another experiment, a wider layer, the same checkpoint folder: it trains from scratch."""
    obs = observation()
    fit_steps(folder, strategy, 4, [ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1)])
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="wide-{step}")
    t, model = fit_steps(folder, strategy, 4, [mc], model=seeded(lambda: DiffModel(hidden=16)))
    obs["wide"] = {
        "start_step": model.fit_start_step,
        "start_weights": model.train_start_weights,
        "step": t.global_step,
    }
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    obs["weights"] = weights(model)
    return obs


def _trials(
    folder: Path, strategy: str, elasticft: dict[str, Any] | None = None, crash_first_at: int | None = None
) -> list[dict[str, Any]]:
    """A hyperparameter loop in one process: a fresh model and Trainer per trial, one checkpoint folder; a trial that
    raises (``crash_first_at``: the first one, after that step) is recorded and the loop goes on."""
    trials = []
    for trial, (lr, max_steps) in enumerate(((0.05, 10), (0.02, 8))):
        mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=5, save_top_k=-1)
        crash = [_CrashAfter(crash_first_at)] if trial == 0 and crash_first_at is not None else []
        model = seeded(lambda lr=lr: DiffModel(lr=lr))
        t = trainer(folder, strategy, elasticft=elasticft, max_steps=max_steps, callbacks=[mc, *crash])
        L.seed_everything(0, verbose=False)
        try:
            t.fit(model)
        except _Crash as e:
            trials.append({"crashed": str(e)})
        trials.append(
            {
                "start_step": model.fit_start_step,
                "start_weights": model.train_start_weights,
                "step": t.global_step,
                "weights": weights(model),
                "checkpoint": checkpoint_state(current(), folder, mc),
            }
        )
    return trials


@scenario
def hyperparameter_loop(folder: Path, strategy: str) -> Observation:
    """Issue 37 (5): each trial of an in-process loop trains from its own initial weights; none resumes the previous
    trial's checkpoint."""
    obs = observation()
    obs["trials"] = _trials(folder, strategy)
    return obs


@scenario
def hyperparameter_loop_memory_tier(folder: Path, strategy: str) -> Observation:
    """Issue 37 (5) with ElasticFT3D's memory tier (every 2 steps): the first trial fails after step 7, leaving a
    memory copy of step 6 newer than its step-5 checkpoint; the next trial resumes neither."""
    obs = observation()
    tier = None
    if strategy == "elasticft":  # the oracle's process never imports lightning_ft
        from lightning_ft import MemoryTier

        tier = {"memory_tier": MemoryTier(every_n_train_steps=2, dirpath=folder / "node-memory")}
    obs["trials"] = _trials(folder, strategy, tier, crash_first_at=7)
    return obs


@scenario
def resume_mid_epoch(folder: Path, strategy: str) -> Observation:
    """A resume from a checkpoint in the middle of an epoch: Lightning restarts a plain DataLoader at the epoch's start,
    lightning-ft continues where it stopped (an exact resume). A documented difference (docs/lightning-compatibility.md,
    "The differential suite"), held by its own test."""
    obs = observation()
    _, straight = fit_steps(folder / "straight", strategy, 8, [], enable_checkpointing=False)
    obs["uninterrupted"] = weights(straight)
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=6, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 6, [mc])
    _, model = fit_steps(folder, strategy, 8, [], enable_checkpointing=False, ckpt_path=folder / "ckpt" / "step=6.ckpt")
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs


# -- the order of restore and hooks (issue 30) -------------------------------------------------------------------------


@scenario
def restore_order(folder: Path, strategy: str) -> Observation:
    """A callback that reads its restored state in ``on_fit_start``: Lightning restores callbacks before that hook."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fit_steps(folder, strategy, 4, [mc, HookOrder()])
    hooks = HookOrder()
    _, model = fit_steps(
        folder, strategy, 6, [hooks], enable_checkpointing=False, ckpt_path=folder / "ckpt" / "step=4.ckpt"
    )
    obs["hooks"] = {"calls": hooks.calls, "seen_at_fit_start": hooks.seen_at_fit_start}
    obs["weights"] = weights(model)
    return obs


@scenario
def backbone_finetuning_resume(folder: Path, strategy: str) -> Observation:
    """Lightning's ``BackboneFinetuning`` unfreezes the backbone at epoch 1 (a new param group); resume after it."""
    obs = observation()
    mc = ModelCheckpoint(dirpath=folder / "ckpt", save_top_k=-1, filename="{epoch}")
    fit_steps(folder, strategy, -1, [mc, BackboneFinetuning(unfreeze_backbone_at_epoch=1)], max_epochs=2)
    obs["checkpoint"] = checkpoint_state(obs, folder, mc)
    _, model = fit_steps(
        folder,
        strategy,
        -1,
        [BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
        max_epochs=3,
        enable_checkpointing=False,
        ckpt_path=folder / "ckpt" / "epoch=1.ckpt",
    )
    obs["resumed"] = {"start_step": model.fit_start_step, "start_weights": model.train_start_weights}
    obs["weights"] = weights(model)
    return obs
