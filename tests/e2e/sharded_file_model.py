"""A small module parallelized by rows (``Shard(0)`` and plain state), for the checkpoint file of DTensor state.

It imports nothing of lightning-ft: a process that loads its checkpoint with ``load_from_checkpoint`` imports it.
``plan="rows"``: a row-parallel embedding and a column-parallel projection whose output is gathered (``Shard(0)``
weights, the embedding's 17 rows uneven over 2 ranks) and a plain head; ``plan="columns"``: the projection's output
stays sharded and the head is row-parallel (its weight is ``Shard(1)``: column blocks, which a file cannot hold).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class RowShardedNet(L.LightningModule):
    def __init__(self, plan: str = "rows") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(17, 8)
        self.proj = nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:  # load_from_checkpoint in a plain process: the module as it is, full tensors
            return
        mesh = self.device_mesh["tensor_parallel"]
        if self.hparams.plan == "rows":
            plan = {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "proj": ColwiseParallel(output_layouts=Replicate()),
            }
        else:
            plan = {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "proj": ColwiseParallel(),
                "head": RowwiseParallel(),
            }
        parallelize_module(self, mesh, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(x)))).mean(dim=(1, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randint(0, 17, (48, 4), generator=g), torch.randn(48, generator=g))
        return DataLoader(data, batch_size=4, shuffle=True)
