"""A step the replica groups discard is not applied and not counted, in Lightning's own loop (one process, a fake
vote in place of torchft's ``should_commit``)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.replica.step_gate import StepGate

DISCARD = {3, 6}  # the 4th and 7th votes say no


class GatedModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.votes = 0
        self.gate = StepGate(self.vote)
        self.seen_global_steps: list[int] = []
        self.weights: list[torch.Tensor] = []

    def vote(self) -> bool:
        self.votes += 1
        return self.votes - 1 not in DISCARD

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def on_train_start(self) -> None:
        self.gate.install(self.trainer)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.gate.begin_step()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.seen_global_steps.append(self.trainer.global_step)
        self.weights.append(self.layer.weight.detach().clone())

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # What ElasticFT3D does around its precision plugin's step, with Lightning's optimizer wrapper in between.
        self.gate.optimizer_step(self.trainer, optimizer, lambda gated: gated.step(closure=optimizer_closure))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)


def test_a_discarded_step_moves_no_weight_and_counts_nowhere(tmp_path) -> None:
    model = GatedModel()
    trainer = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    model.gate.uninstall()
    optimizer = trainer.optimizers[0]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert model.votes == 10 and model.gate.discarded == 2  # 10 batches for 8 committed steps
    assert trainer.global_step == 8
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 8
    assert model.seen_global_steps == [1, 2, 3, 3, 4, 5, 5, 6, 7, 8]
    moved = [not torch.equal(a, b) for a, b in zip(model.weights, model.weights[1:], strict=False)]
    assert moved == [True, True, False, True, True, False, True, True, True]
    assert scheduler.last_epoch == 8 and optimizer.param_groups[0]["lr"] == 0.1 * 0.5**8
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    assert progress.total.ready == progress.total.completed == 8
    sched_progress = trainer.fit_loop.epoch_loop.scheduler_progress
    assert sched_progress.total.ready == sched_progress.total.completed == 8
    assert "lr_scheduler_step" not in vars(model)  # the wrap is undone
