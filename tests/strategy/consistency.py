"""The consistency matrix: user code writes the state right after a save, in every way and at every point Lightning
lets it; every committed checkpoint must still hold, bitwise, the state at its save call.

What a save must hold is recorded by :class:`SaveCallRecorder`, which wraps the strategy's ``save_checkpoint`` and
deep-copies the checkpoint dict Lightning hands it, at the call. After ``fit``, :func:`check_committed` loads every
committed checkpoint and compares it with that copy: parameters, buffers, optimizer and scheduler state, loops, hyper-
parameters and every callback's state.

The window after a save: Lightning moves ``ModelCheckpoint`` callbacks behind every other callback, so a save at
``on_train_batch_end`` is followed by the LightningModule's ``on_train_batch_end``, then (when due) the validation loop,
the epoch end (callbacks, then the module), the next epoch's start, the next batch's start, ``training_step``, the
backward hooks and the optimizer step; or ``on_train_end`` and ``on_fit_end``. Saves at ``on_validation_end`` and
``on_train_epoch_end`` are followed by the rest of those hooks. :data:`CALLBACK_HOOKS` and :data:`MODULE_HOOKS` are
those hooks; :data:`WRITES` the kinds of write. A :class:`Writer` callback and a :class:`WritingModule` write at one
chosen hook after every save, cycling through the kinds of write.

Importable by the in-process tests and runnable under torchrun (``python -m torch.distributed.run ... consistency.py
--root DIR --hook NAME``) for the 2-rank cases.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.checkpoint import CheckpointError, discovery, load_checkpoint
from lightning_ft.checkpoint.single_file import without_sampler_states
from lightning_ft.strategy import per_rank_state


def _params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


def _optimizer(trainer: L.Trainer) -> torch.optim.Optimizer:
    return trainer.optimizers[0]


def _in_place_no_grad(trainer: L.Trainer, module: nn.Module) -> None:
    with torch.no_grad():
        for p in _params(module):
            p.mul_(0.9).add_(0.01)


def _through_data(trainer: L.Trainer, module: nn.Module) -> None:
    for p in _params(module):
        p.data.add_(0.02)  # .data has a version counter of its own: invisible to the parameter's


def _assign_data(trainer: L.Trainer, module: nn.Module) -> None:
    for p in _params(module):
        p.data = p.data * 0.95  # a new storage behind the same Parameter


def _load_state_dict(trainer: L.Trainer, module: nn.Module) -> None:
    other = {k: v * 0.5 if v.is_floating_point() else v + 1 for k, v in module.state_dict().items()}
    module.load_state_dict(other)


def _buffers_in_place(trainer: L.Trainer, module: nn.Module) -> None:
    for b in module.buffers():
        b.add_(1)


def _optimizer_state_in_place(trainer: L.Trainer, module: nn.Module) -> None:
    for state in _optimizer(trainer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.add_(0.5)


def _optimizer_state_replaced(trainer: L.Trainer, module: nn.Module) -> None:
    optimizer = _optimizer(trainer)
    for p in list(optimizer.state):
        optimizer.state[p] = {
            k: v * 0.0 + 0.125 if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()
        }


def _optimizer_load_state_dict(trainer: L.Trainer, module: nn.Module) -> None:
    optimizer = _optimizer(trainer)
    other = copy.deepcopy(optimizer.state_dict())
    for state in other["state"].values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v * 2
    other["param_groups"][0]["lr"] = other["param_groups"][0]["lr"] * 0.5
    optimizer.load_state_dict(other)


def _scheduler_stepped(trainer: L.Trainer, module: nn.Module) -> None:
    trainer.lr_scheduler_configs[0].scheduler.step()


def _param_group_changed(trainer: L.Trainer, module: nn.Module) -> None:
    for group in _optimizer(trainer).param_groups:
        group["lr"] = group["lr"] * 1.5


WRITES: dict[str, Callable[[L.Trainer, nn.Module], None]] = {
    "in place under no_grad": _in_place_no_grad,
    "through .data": _through_data,
    "param.data = new tensor": _assign_data,
    "module.load_state_dict": _load_state_dict,
    "buffers in place": _buffers_in_place,
    "optimizer state in place": _optimizer_state_in_place,
    "optimizer state replaced": _optimizer_state_replaced,
    "optimizer.load_state_dict": _optimizer_load_state_dict,
    "scheduler stepped": _scheduler_stepped,
    "param group changed": _param_group_changed,
}
"""Every kind of write user code makes to the state a save holds."""

CALLBACK_HOOKS = (
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_end",
    "on_fit_end",
)
"""Callback hooks Lightning runs between a save and the next point where nothing of the user's runs."""

MODULE_HOOKS = (
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "validation_step",
    "on_train_epoch_end",
    "on_train_epoch_start",
    "on_train_batch_start",
    "training_step",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_end",
    "on_fit_end",
)
"""LightningModule hooks in the same window (Lightning calls them after the callbacks' hook of the same name)."""

ONCE_PER_FIT = {"on_train_end", "on_fit_end"}
EPOCH_LEVEL = {
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "validation_step",
    "on_train_epoch_end",
    "on_train_epoch_start",
}
NOT_BEFORE_BACKWARD = {"in place under no_grad", "module.load_state_dict", "buffers in place"}
"""Writes that bump the version counter of a tensor the backward pass saved (parameters, BatchNorm's running
statistics): autograd refuses them between forward and backward under any strategy, so user code cannot make them
there. Lightning calls ``on_before_zero_grad`` there too (its closure runs ``training_step``, then ``zero_grad``, then
the backward)."""
BETWEEN_FORWARD_AND_BACKWARD = {"on_before_backward", "on_before_zero_grad"}


def kinds_for(hook: str) -> list[str]:
    """The kinds of write a hook can make (all, except what autograd refuses before backward)."""
    return [k for k in WRITES if not (hook in BETWEEN_FORWARD_AND_BACKWARD and k in NOT_BEFORE_BACKWARD)]


def kinds_per_firing(hook: str) -> int:
    """How many kinds one firing applies, so that every kind is applied once in a :func:`run` (10 steps, 5 epochs)."""
    if hook in ONCE_PER_FIT:
        return len(WRITES)
    return 3 if hook in EPOCH_LEVEL else 2


class SaveCallRecorder:
    """Deep-copies the checkpoint dict at every call of the strategy's ``save_checkpoint``: what each save must hold."""

    def __init__(self, strategy: Any) -> None:
        self.saves: list[tuple[str, dict[str, Any]]] = []
        inner = strategy.save_checkpoint

        def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            self.saves.append((str(filepath), copy.deepcopy(checkpoint)))
            inner(checkpoint, filepath, storage_options)

        strategy.save_checkpoint = save_checkpoint

    @property
    def count(self) -> int:
        return len(self.saves)


class _WritesAfterSaves:
    """Applies the next kind of write at ``hook`` once per save (all kinds at once where the hook fires once)."""

    def __init__(self, hook: str | None, recorder_ref: list[SaveCallRecorder], who: str) -> None:
        self.hook = hook
        self.recorder_ref = recorder_ref
        self.who = who
        self.seen_saves = 0
        self.applied: list[tuple[int, str]] = []

    def maybe_write(self, name: str, trainer: L.Trainer, module: nn.Module) -> None:
        if name != self.hook or not self.recorder_ref:
            return
        saves = self.recorder_ref[0].count
        if saves == self.seen_saves:
            return
        self.seen_saves = saves
        kinds = kinds_for(name)
        for _ in range(kinds_per_firing(name)):
            kind = kinds[len(self.applied) % len(kinds)]
            WRITES[kind](trainer, module)
            self.applied.append((saves, kind))


def _callback_hook(name: str) -> Callable[..., None]:
    def hook(self: Writer, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        self.writes.maybe_write(name, trainer, pl_module)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(1.0)  # the callback's own state, which its state_dict returns by reference
        self.count += 1

    hook.__name__ = name
    return hook


class Writer(Callback):
    """A user callback writing the state at ``hook`` after every save; its own state holds a tensor it mutates."""

    def __init__(self, hook: str | None, recorder_ref: list[SaveCallRecorder]) -> None:
        self.writes = _WritesAfterSaves(hook, recorder_ref, "callback")
        self.ema = torch.zeros(4)
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ema = state_dict["ema"]
        self.count = state_dict["count"]


for _name in CALLBACK_HOOKS:
    setattr(Writer, _name, _callback_hook(_name))


class WritingModule(L.LightningModule):
    """Linear -> BatchNorm -> Tanh -> Linear, Adam with StepLR; writes its own state at ``hook`` after every save."""

    def __init__(self, hook: str | None = None, recorder_ref: list[SaveCallRecorder] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.writes = _WritesAfterSaves(hook, recorder_ref if recorder_ref is not None else [], "module")

    def _hook(self, name: str) -> None:
        self.writes.maybe_write(name, self.trainer, self)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._hook("training_step")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._hook("validation_step")
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _module_hook(name: str) -> Callable[..., None]:
    def hook(self: WritingModule, *args: Any, **kwargs: Any) -> None:
        self._hook(name)

    hook.__name__ = name
    return hook


for _name in MODULE_HOOKS:
    if _name not in ("training_step", "validation_step"):
        setattr(WritingModule, _name, _module_hook(_name))


def checkpoint_callbacks(dirpath: Path) -> list[ModelCheckpoint]:
    """Saves at every point Lightning saves: every step (with ``last``), at validation end and at train epoch end."""
    return [
        ModelCheckpoint(dirpath=dirpath, filename="step-{step}", every_n_train_steps=1, save_top_k=-1, save_last=True),
        ModelCheckpoint(
            dirpath=dirpath,
            filename="val-{epoch}-{step}",
            monitor="val_loss",
            every_n_epochs=1,
            save_top_k=-1,
            save_on_train_epoch_end=False,
        ),
        ModelCheckpoint(
            dirpath=dirpath,
            filename="epoch-{epoch}-{step}",
            every_n_epochs=1,
            save_top_k=-1,
            save_on_train_epoch_end=True,
        ),
    ]


def trainer_for(root: Path, strategy: Any, callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        strategy=strategy,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        log_every_n_steps=1,
        max_epochs=5,
        callbacks=callbacks,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def _differences(expected: Any, actual: Any, path: str, out: list[str]) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            out.append(f"{path}: a tensor was saved as {type(actual).__name__}")
        elif expected.dtype != actual.dtype or expected.shape != actual.shape:
            out.append(f"{path}: {expected.dtype}{list(expected.shape)} saved as {actual.dtype}{list(actual.shape)}")
        elif not torch.equal(
            expected.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
            actual.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        ):
            out.append(f"{path}: tensor values differ from the state at the save call")
    elif isinstance(expected, dict):
        if set(map(str, expected)) != set(map(str, actual)):
            out.append(f"{path}: keys {sorted(map(str, expected))} saved as {sorted(map(str, actual))}")
            return
        by_str = {str(k): v for k, v in actual.items()}
        for key, value in expected.items():
            _differences(value, by_str[str(key)], f"{path}/{key}", out)
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            out.append(f"{path}: {expected!r} saved as {actual!r}")
            return
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _differences(e, a, f"{path}/{i}", out)
    elif isinstance(expected, float) and math.isnan(expected):
        if not (isinstance(actual, float) and math.isnan(actual)):
            out.append(f"{path}: nan saved as {actual!r}")
    elif expected != actual:
        out.append(f"{path}: {expected!r} saved as {actual!r}")


def differences(expected: dict[str, Any], path: Path) -> list[str]:
    """What the committed checkpoint at ``path`` holds that differs from ``expected`` (a save call's dict)."""
    try:
        loaded = load_checkpoint(path, None, collective=False)
    except CheckpointError as e:  # bytes changed after their checksum was taken: a leak too
        return [f": cannot be loaded ({type(e).__name__}: {e})"]
    out: list[str] = []
    shared = {k: v for k, v in expected.items() if k != "callbacks"}
    # Tensors that differ between ranks (BatchNorm statistics) are this rank's own in its rank state.
    own = per_rank_state.restore_own(dict(loaded.state), loaded.rank_state or {}, same_world=True)
    _differences(shared, own, "", out)
    _differences(expected.get("callbacks", {}), loaded.rank_state.get("callbacks", {}), "callbacks", out)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if path.is_file() and rank == 0:
        # A checkpoint file: what Lightning's own readers see (torch.load of the pickled dict) is the call's state too,
        # less lightning-ft's sampler positions among the loaders' states (by design: see without_sampler_states).
        # Written by several ranks, it is Lightning's dict as rank 0 holds it (as under DDPStrategy); another rank's
        # own values (BatchNorm statistics, callbacks' states) are in the record, compared above.
        plain = torch.load(path, map_location="cpu", weights_only=True)
        plain.pop("lightning_ft", None)
        lightning_view = (
            {**expected, "loops": without_sampler_states(expected["loops"])} if "loops" in expected else expected
        )
        _differences(lightning_view, plain, " (torch.load)", out)
    return out


def check_committed(recorder: SaveCallRecorder) -> tuple[int, list[str]]:
    """Compare every committed checkpoint with its save call; returns (checkpoints compared, differences).

    A path saved more than once (``last``) is compared with its newest save only: the older states are superseded.
    Every save path must be committed."""
    newest: dict[str, dict[str, Any]] = {}
    for filepath, checkpoint in recorder.saves:
        newest[filepath] = checkpoint
    problems: list[str] = []
    for filepath, checkpoint in newest.items():
        path = Path(filepath)
        if path.is_symlink():
            path = path.resolve()
        if not discovery.is_committed(path):
            problems.append(f"{filepath}: not committed")
            continue
        problems += [f"{Path(filepath).name}{p}" for p in differences(checkpoint, path)]
    return len(newest), problems


def run(
    root: Path,
    *,
    hook: str | None,
    where: str,
    checkpoint_format: str,
    replica_groups: Any = None,
    **trainer_kwargs: Any,
) -> tuple[int, list[str], list[tuple[int, str]]]:
    """One fit where ``where`` ("callback" or "module") writes at ``hook`` after every save; returns what
    :func:`check_committed` found and the writes applied ``(saves so far, kind)``. ``replica_groups``: the fit is
    one replica group (``ElasticFT3D(replica_groups=...)``)."""
    from lightning_ft import ElasticFT3D

    recorder_ref: list[SaveCallRecorder] = []
    writer = Writer(hook if where == "callback" else None, recorder_ref)
    module = WritingModule(hook if where == "module" else None, recorder_ref)
    strategy = ElasticFT3D(checkpoint_format=checkpoint_format, replica_groups=replica_groups)
    recorder_ref.append(SaveCallRecorder(strategy))
    trainer = trainer_for(root, strategy, [writer, *checkpoint_callbacks(root / "checkpoints")], **trainer_kwargs)
    trainer.fit(module)
    applied = writer.writes.applied if where == "callback" else module.writes.applied
    compared, problems = check_committed(recorder_ref[0])
    return compared, problems, applied


def main() -> None:  # torchrun entry: every rank runs the fit; rank 0 compares and writes the verdict
    import json

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--hook", required=True)
    parser.add_argument("--where", choices=("callback", "module"), required=True)
    parser.add_argument("--format", default="torchsnapshot")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compared, problems, applied = run(
        args.root, hook=args.hook, where=args.where, checkpoint_format=args.format, devices="auto"
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    verdict = {"compared": compared, "problems": problems, "applied": applied}
    (args.root / f"verdict_rank{rank}.json").write_text(json.dumps(verdict))


if __name__ == "__main__":
    main()
