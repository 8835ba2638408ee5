"""The restore-order scenarios: one user script, run under ``DDPStrategy`` (the oracle) and under ``ElasticFT3D``.

Each scenario trains a first fit that saves at every epoch end, then a second fit in a fresh Trainer resumes it (under
``DDPStrategy`` with ``ckpt_path="last"``, as its user writes it; under ``ElasticFT3D`` by auto-resume, as after a
torchrun restart) and trains on. What the user can observe is written to ``--out``: the final weights, the optimizer's
param groups and state, the hooks in the order Lightning called them, and what callbacks saw in ``on_fit_start``.

- ``finetuning``: Lightning's ``BackboneFinetuning`` unfreezes the backbone at epoch 1 (a second param group); the
  second fit resumes after that.
- ``swa``: Lightning's ``StochasticWeightAveraging`` from epoch 1 (its averaged model, counts and ``SWALR`` state).
- ``tensor_parallel``: the module is parallelized in ``configure_model`` (``tensor_parallel_size=2``, ElasticFT3D
  only); the state-reading callback and the module's ``on_load_checkpoint`` as in the others.

Every scenario also carries :class:`ReadsStateAtFitStart` (a callback that reads its restored state in
``on_fit_start``) and a module that records its hooks. Importable by the in-process tests and runnable under torchrun
(``python -m torch.distributed.run ... restore_scenarios.py --scenario NAME --strategy ddp|elasticft --root DIR
--max-epochs N --out DIR``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SCENARIOS = ("finetuning", "swa", "tensor_parallel")


class HookLog:
    """The hooks of one fit, in the order they ran (the same list on the module and the callback)."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class ReadsStateAtFitStart(Callback):
    """Counts the batches it has seen (its state); reads the count in ``on_fit_start``, where a resumed count must be
    the one it saved."""

    def __init__(self, log: HookLog) -> None:
        self.hooks = log
        self.batches = 0
        self.seen_at_fit_start: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.hooks.calls.append("callback.load_state_dict")
        self.batches = state_dict["batches"]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.hooks.calls.append("callback.setup")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.hooks.calls.append("callback.on_fit_start")
        self.seen_at_fit_start = self.batches

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.hooks.calls.append("callback.on_train_start")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batches += 1


class Backboned(L.LightningModule):
    """A ``backbone`` and a ``head``; the optimizer holds what is trainable when it is configured (BaseFinetuning's
    contract). Records its hooks; saves a marker that ``on_load_checkpoint`` puts back and ``on_fit_start`` reads."""

    def __init__(self, log: HookLog, *, tensor_parallel: bool = False) -> None:
        super().__init__()
        self.hooks = log
        self.tensor_parallel = tensor_parallel
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.marker = 0
        self.marker_at_fit_start: int | None = None

    def configure_model(self) -> None:
        self.hooks.calls.append("module.configure_model")
        if self.tensor_parallel:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = self.device_mesh["tensor_parallel"]
            parallelize_module(self.head, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["marker"] = self.global_step

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.hooks.calls.append("module.on_load_checkpoint")
        self.marker = checkpoint["marker"]

    def on_fit_start(self) -> None:
        self.hooks.calls.append("module.on_fit_start")
        self.marker_at_fit_start = self.marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        self.hooks.calls.append("module.configure_optimizers")
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        self.own_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": self.own_scheduler}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        return DataLoader(data, batch_size=4, shuffle=False)  # 4 steps per epoch (per process: 2 on two)


def callbacks_for(scenario: str, log: HookLog, dirpath: Path) -> list[Callback]:
    callbacks: list[Callback] = [
        ReadsStateAtFitStart(log),
        ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1, save_last=True),
    ]
    if scenario == "finetuning":
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5))
    elif scenario == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=2))
    return callbacks


def fit(
    scenario: str,
    strategy: str,
    root: Path,
    max_epochs: int,
    *,
    devices: int | str = 1,
) -> tuple[L.Trainer, Backboned, ReadsStateAtFitStart, HookLog]:
    """One fit of ``scenario`` under ``strategy`` (``"ddp"`` or ``"elasticft"``) in ``root``; resumes what ``root``
    holds (DDPStrategy: ``ckpt_path="last"`` when a ``last`` checkpoint exists; ElasticFT3D: auto-resume)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ft import ElasticFT3D

    torch.manual_seed(0)
    log = HookLog()
    dirpath = root / "ckpt"
    if strategy == "ddp":
        chosen: Any = DDPStrategy()
        ckpt_path = "last" if (dirpath / "last.ckpt").exists() else None
    else:
        chosen = ElasticFT3D(tensor_parallel_size=2 if scenario == "tensor_parallel" else 1)
        ckpt_path = None
    module = Backboned(log, tensor_parallel=scenario == "tensor_parallel")
    callbacks = callbacks_for(scenario, log, dirpath)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=chosen,
        default_root_dir=root,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module, callbacks[0], log


def observed(trainer: L.Trainer, module: Backboned, reader: ReadsStateAtFitStart, log: HookLog) -> dict[str, Any]:
    """What the user can observe after a fit (full tensors: a DTensor's local shards are gathered)."""

    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    optimizer = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "weights": {k: full(v).detach().clone() for k, v in module.state_dict().items()},
        "param_groups": [
            {"params": [names[id(p)] for p in g["params"]], "lr": g["lr"]} for g in optimizer.param_groups
        ],
        "momentum": {
            names[id(p)]: full(s["momentum_buffer"]).clone()
            for p, s in optimizer.state.items()
            if s.get("momentum_buffer") is not None
        },
        "schedulers": [
            (type(c.scheduler).__name__, _plain(c.scheduler.state_dict())) for c in trainer.lr_scheduler_configs
        ],
        # The module's own scheduler object: StochasticWeightAveraging swaps it for its SWALR, and a resume must not
        # load SWALR's state into it (SWA takes it out of Lightning's restore in on_fit_start, from its restored state).
        "own_scheduler": _plain(module.own_scheduler.state_dict()),
        "averaged": _averaged(trainer),
        "hooks": log.calls,
        "callback_state_at_fit_start": reader.seen_at_fit_start,
        "marker_at_fit_start": module.marker_at_fit_start,
        "global_step": trainer.global_step,
    }


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """A scheduler's state without what a copy of a function holds (``SWALR`` keeps its annealing function)."""
    return {k: v for k, v in state.items() if not callable(v)}


def _averaged(trainer: L.Trainer) -> dict[str, Any] | None:
    """What a ``StochasticWeightAveraging`` callback holds: its count and averaged weights."""
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            model = callback._average_model
            return {
                "n_averaged": None if callback.n_averaged is None else int(callback.n_averaged),
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()} if model else None,
            }
    return None


def main() -> None:  # torchrun entry: every rank fits and writes what it observed (rank 0 to --out)
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--strategy", choices=("ddp", "elasticft"), required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer, module, reader, log = fit(args.scenario, args.strategy, args.root, args.max_epochs, devices=devices)
    seen = observed(trainer, module, reader, log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(seen, args.out if trainer.global_rank == 0 else args.out.with_suffix(f".rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
