"""A small GPT-style LightningModule on synthetic tokens: the model every lightning-ft example and end-to-end test uses.

It runs on CPU in seconds. ``configure_model()`` applies tensor parallelism when the strategy's mesh has a
``"tensor_parallel"`` axis larger than one (the same shape as Lightning's own tensor-parallel example) and leaves the
model alone otherwise, so the same module trains under ``DDPStrategy``, ``ModelParallelStrategy`` and ``ElasticFT3D``.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_ft.parallel.pipeline import pipeline_step


class SyntheticTokens(Dataset):
    """Deterministic token sequences: sample ``i`` is the same on every rank and in every run."""

    def __init__(self, num_samples: int = 512, seq_len: int = 32, vocab_size: int = 256, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        # A learnable pattern: each sequence is an arithmetic progression modulo the vocabulary.
        starts = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        steps = torch.randint(1, 7, (num_samples, 1), generator=g)
        self.data = (starts + steps * torch.arange(seq_len + 1)) % vocab_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.data[index]
        return row[:-1], row[1:]


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.ln1 = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 for the head dimension: under tensor parallelism each rank holds n_heads / tp heads.
        q = self.wq(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.wo(att.transpose(1, 2).reshape(b, t, -1)))
        return x + self.dropout(self.w2(F.gelu(self.w1(self.ln2(x)))))


class Embed(nn.Module):
    """Token plus learned position embedding: the first pipeline block."""

    def __init__(self, vocab_size: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Head(nn.Module):
    """Final norm and vocabulary projection: the last pipeline block."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


class GPT(L.LightningModule):
    """A decoder-only transformer with ``n_layers`` blocks.

    Example::

        model = GPT(vocab_size=256, dim=64, n_heads=4, n_layers=2)
        trainer = L.Trainer(max_steps=20, strategy=ElasticFT3D())
        trainer.fit(model, train_dataloaders=DataLoader(SyntheticTokens(), batch_size=8, shuffle=True))
    """

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        seq_len: int = 32,
        dropout: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = Embed(vocab_size, dim, seq_len)
        self.blocks = nn.ModuleList(Block(dim, n_heads, dropout) for _ in range(n_layers))
        self.head = Head(dim, vocab_size)
        for block in self.blocks:
            nn.init.normal_(block.wo.weight, std=0.02 / math.sqrt(2 * n_layers))

    def configure_model(self) -> None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
        pipelined = "pipeline_parallel" in mesh.mesh_dim_names and mesh["pipeline_parallel"].size() > 1
        if tp_mesh.size() == 1:
            return  # plain data parallel (ElasticFT3D wraps the module in DDP) or pipeline stages alone
        # Megatron-style: column-parallel in, row-parallel out, so each block needs one all-reduce per matmul pair.
        plan = {
            "wq": ColwiseParallel(),
            "wk": ColwiseParallel(),
            "wv": ColwiseParallel(),
            "wo": RowwiseParallel(),
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
        }
        for block in self.blocks:
            parallelize_module(block, tp_mesh, plan)
        if pipelined:
            return  # the pipeline runner averages stage gradients over data parallel itself
        from torch.distributed.fsdp import fully_shard

        # FSDP2 over the data-parallel axis, as in Lightning's tensor-parallel example.
        for block in self.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    # The pipeline contract (docs/parallelism.md): blocks in execution order, and the loss written once.
    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for block in self.pipeline_blocks():
            x = block(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        # Runs the blocks and the loss directly, or the pipeline schedule when ElasticFT3D has pipeline stages.
        loss = pipeline_step(self, inputs, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
