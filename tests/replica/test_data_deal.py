"""The replica mode's data deal in Lightning's own loop (one process, a scripted membership and vote in place of
torchft's quorum and ``should_commit``): each committed step trains the stream block the contract names, a discarded
step's batch comes again, a joining group's batch in hand is replaced, and the epoch ends where the deal ends."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.elastic import ResumableSampler
from lightning_ft.replica.data_deal import ReplicaDataDeal
from lightning_ft.replica.step_gate import StepGate

BATCH, SEED = 4, 7
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
            if trainer.lightning_module.votes_at_step_start != len(trainer.lightning_module.votes):
                trainer.lightning_module.votes_at_step_start = len(trainer.lightning_module.votes)
                trainer.lightning_module.gate.begin_step()
            live, index = membership(trainer.global_step, trainer.current_epoch)
            members = tuple(str(g) for g in range(live))
            if self.deal.after_quorum(live_groups=live, group_index=index, members=members, step=trainer.global_step):
                batch = self.deal.refetch(batch)
            self.deal.count_batch()
        return super().batch_to_device(batch, device, dataloader_idx)


class Model(L.LightningModule):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.votes_at_step_start = -1
        self.layer = torch.nn.Linear(1, 1)
        self.gate = StepGate(self.vote)
        self.votes: list[bool] = []
        self.batch_indices: list[tuple[int, int]] = []
        # (epoch, step, samples, membership, the vote the batch belongs to)
        self.trained: list[tuple[int, int, list[int], tuple[int, int], int]] = []

    def vote(self) -> bool:
        committed = len(self.votes) not in DISCARD
        self.votes.append(committed)
        self.trainer.strategy.deal.after_vote(committed, step=self.trainer.global_step)
        return committed

    def training_step(self, batch, batch_idx):
        step, epoch = self.trainer.global_step, self.trainer.current_epoch
        self.trained.append((epoch, step, batch[0].tolist(), membership(step, epoch), len(self.votes)))
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
        sampler = ResumableSampler(self.n, num_replicas=3, rank=0, shuffle=True, seed=SEED, batch_size=BATCH)
        return DataLoader(TensorDataset(torch.arange(self.n)), batch_size=BATCH, sampler=sampler)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_committed_step_trains_its_block_of_the_stream_and_a_discarded_batch_comes_again(
    tmp_path, accumulate: int
) -> None:
    n = 48 * accumulate  # the same schedule of steps for either accumulation
    model, strategy = Model(n), ScriptedQuorum()
    trainer = L.Trainer(
        max_steps=12,
        accumulate_grad_batches=accumulate,
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
    # group the stream positions c + i + L x j (j < its batches x batch size, over its micro-batches in order), and the
    # committed count moves by L x that.
    def order(epoch: int) -> list[int]:
        return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()

    steps: dict[int, list[Any]] = defaultdict(list)  # vote -> its micro-batches
    for record in model.trained:
        steps[record[4]].append(record)
    committed: defaultdict[int, int] = defaultdict(int)
    for vote, records in sorted(steps.items()):
        epoch, step, _, (live, index), _ = records[0]
        samples = [i for r in records for i in r[2]]
        expected = [order(epoch)[committed[epoch] + index + live * j] for j in range(len(samples))]
        assert samples == expected, (epoch, step, committed[epoch])
        if model.votes[vote]:
            committed[epoch] += live * len(samples)
    # A discarded step's batches are trained again by the next step (the same membership).
    (discarded,) = [v for v, ok in enumerate(model.votes) if not ok]
    assert [r[2] for r in steps[discarded]] == [r[2] for r in steps[discarded + 1]]
    # Epoch 0 ends where its stream ends (5 steps alone, 2 committed of two groups, 1 of three: 20 + 16 + 12 = 48
    # positions per batch of accumulation), and epoch 1 is dealt over the three groups from its start: 4 steps.
    per_epoch = [sum(1 for v, rs in steps.items() if rs[0][0] == epoch and model.votes[v]) for epoch in (0, 1)]
    assert per_epoch == [8, 4] and dict(committed) == {0: n, 1: n}, (per_epoch, dict(committed))
    assert trainer.global_step == 12
    # Lightning's batch counter follows the epoch as the deal sizes it: never negative, and the epoch's last batch is
    # its last by count (validation at the epoch's end keeps working). The batch that replaces the one in hand at a
    # membership deal is told the batch_idx Lightning counted before the deal (a known limit).
    assert all(idx >= 0 for idx, _ in model.batch_indices), model.batch_indices
    assert model.batch_indices[-1] == (4 * accumulate - 1, 4 * accumulate), model.batch_indices
    reasons = [(e["step"], e["live_groups"], e["reason"]) for e in strategy.events]
    assert reasons == [(0, 1, "membership"), (5, 2, "membership"), (6, 2, "discarded"), (7, 3, "membership")] + [
        (8, 3, "epoch")
    ]
    assert all(e["skipped"] == [] for e in strategy.events)
