"""The replica mode's data deal in Lightning's own loop (one process, a scripted membership and vote in place of
torchft's quorum and ``should_commit``): each committed step trains the stream block the contract names, a discarded
step's batch comes again, a joining group's batch in hand is replaced, and the epoch ends where the deal ends."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.elastic import ResumableSampler
from lightning_ft.replica.data_deal import ReplicaDataDeal
from lightning_ft.replica.step_gate import StepGate

N, BATCH, SEED = 48, 4, 7
DISCARD = {6}  # the 7th vote says no (the second step with two live groups)


def membership(step: int, epoch: int) -> tuple[int, int]:
    """(live groups, this group's index) at committed step ``step``: alone for 5 steps (longer than the epoch
    Lightning sized for a third of the data), then 2 groups (this one second), then 3."""
    if epoch > 0 or step >= 7:
        return 3, 0
    return (1, 0) if step < 5 else (2, 1)


class ScriptedQuorum(SingleDeviceStrategy):
    """What ElasticFT3D's ``batch_to_device`` does with a quorum, the membership taken from :func:`membership`."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.deal: ReplicaDataDeal | None = None
        self.events: list[dict[str, Any]] = []

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module.trainer
        if trainer.training:
            if self.deal is None:
                self.deal = ReplicaDataDeal(
                    trainer,
                    group_size=1,
                    local_rank=0,
                    write=lambda event, **fields: self.events.append({"event": event, **fields}),
                    hold=lambda sampler: None,
                )
            trainer.lightning_module.gate.begin_step()
            live, index = membership(trainer.global_step, trainer.current_epoch)
            members = tuple(str(g) for g in range(live))
            if self.deal.after_quorum(live_groups=live, group_index=index, members=members, step=trainer.global_step):
                batch = self.deal.refetch(batch)
        return super().batch_to_device(batch, device, dataloader_idx)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.gate = StepGate(self.vote)
        self.votes: list[bool] = []
        self.batch_indices: list[tuple[int, int]] = []
        self.trained: list[tuple[int, int, list[int], tuple[int, int]]] = []  # (epoch, step, samples, membership)

    def vote(self) -> bool:
        committed = len(self.votes) not in DISCARD
        self.votes.append(committed)
        self.trainer.strategy.deal.after_vote(committed, step=self.trainer.global_step)
        return committed

    def training_step(self, batch, batch_idx):
        step, epoch = self.trainer.global_step, self.trainer.current_epoch
        self.trained.append((epoch, step, batch[0].tolist(), membership(step, epoch)))
        self.batch_indices.append((batch_idx, self.trainer.num_training_batches))
        return self.layer(batch[0].float()[:, None]).square().mean()

    def on_train_start(self) -> None:
        self.gate.install(self.trainer)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        self.gate.optimizer_step(self.trainer, optimizer, lambda gated: gated.step(closure=optimizer_closure))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        # Part 0 of 3 groups, as the strategy sets it before the first quorum: Lightning sizes the epoch from it
        # (4 batches), and the deal must make the epoch as long as its own rest (12 batches while alone).
        sampler = ResumableSampler(N, num_replicas=3, rank=0, shuffle=True, seed=SEED, batch_size=BATCH)
        return DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, sampler=sampler)


def _order(epoch: int) -> list[int]:
    return torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def test_each_committed_step_trains_its_block_of_the_stream_and_a_discarded_batch_comes_again(tmp_path) -> None:
    model, strategy = Model(), ScriptedQuorum()
    trainer = L.Trainer(
        max_steps=12,
        accelerator="cpu",
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)

    # The contract: a committed step of live groups L, this group's index i, from committed count c, trains on this
    # group the stream positions c + i + L x j (j < batch), and the committed count moves by L x batch.
    committed: defaultdict[int, int] = defaultdict(int)
    batches = [(t, ok) for t, ok in zip(model.trained, model.votes, strict=True)]
    for (epoch, step, samples, (live, index)), ok in batches:
        expected = [_order(epoch)[committed[epoch] + index + live * j] for j in range(BATCH)]
        assert samples == expected, (epoch, step, committed[epoch])
        if ok:
            committed[epoch] += live * BATCH
    # A discarded step's batch is trained again by the next step (the same membership).
    (discarded,) = [k for k, (_, ok) in enumerate(batches) if not ok]
    assert batches[discarded][0][2] == batches[discarded + 1][0][2]
    # Epoch 0 ends where its stream ends (5 steps alone, 2 committed of two groups, 1 of three: 20 + 16 + 12 = 48),
    # and epoch 1 is dealt over the three groups from its start: 4 steps of 12.
    per_epoch = [sum(1 for (e, *_), ok in batches if e == epoch and ok) for epoch in (0, 1)]
    assert per_epoch == [8, 4] and dict(committed) == {0: N, 1: N}, (per_epoch, dict(committed))
    assert trainer.global_step == 12
    # Lightning's batch counter follows the epoch as the deal sizes it: never negative, and the epoch's last batch is
    # its last by count (validation at the epoch's end keeps working). The batch that replaces the one in hand at a
    # membership deal is told the batch_idx Lightning counted before the deal (a known limit).
    assert all(idx >= 0 for idx, _ in model.batch_indices), model.batch_indices
    assert model.batch_indices[-1] == (3, 4), model.batch_indices
    reasons = [(e["step"], e["live_groups"], e["reason"]) for e in strategy.events]
    assert reasons == [(0, 1, "membership"), (5, 2, "membership"), (6, 2, "discarded"), (7, 3, "membership")] + [
        (8, 3, "epoch")
    ]
    assert all(e["skipped"] == [] for e in strategy.events)
