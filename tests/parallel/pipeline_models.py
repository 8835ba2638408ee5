"""A tiny GPT-style model that follows the pipeline contract, for the pipeline tests.

The model is written the way a Lightning user would write it for pipeline parallelism: an embedding, a list of
transformer blocks and a head, handed over in order by ``pipeline_blocks()``, and the loss written once in
``pipeline_loss()``. ``parallelize_blocks`` is what the user's ``configure_model`` does for tensor parallelism.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ft.parallel.pipeline import PipelineRunner, pipeline_step


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        # Separate q, k, v projections so that a column-wise split hands whole heads to each tensor-parallel rank.
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class TinyGPT(nn.Module):
    """Vocabulary 64, hidden 32, 4 heads, 4 blocks, sequence 16 unless told otherwise."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, layers: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.seq = seq
        self.embed = Embedding(vocab, hidden, seq)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = Head(hidden, vocab)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for block in self.pipeline_blocks():
            x = block(x)
        return x


def parallelize_blocks(model: TinyGPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism for every transformer block (what ``configure_model`` would do)."""
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        if isinstance(block, Block):
            parallelize_module(block, tp_mesh, plan)


def make_batches(
    steps: int, batch: int, vocab: int = 64, seq: int = 16, seed: int = 1234, pool: int = 2
) -> list[tuple]:
    """The same next-token batches on every process: (tokens, targets) of shape (batch, seq).

    The steps cycle through ``pool`` distinct batches, so that a few steps of training visibly lower the loss.
    """
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (pool, batch, seq + 1), generator=gen)
    return [(data[i % pool, :, :-1].contiguous(), data[i % pool, :, 1:].contiguous()) for i in range(steps)]


class LitTinyGPT(L.LightningModule):
    """The pipeline contract as a LightningModule: blocks, loss, and ``pipeline_step`` in the step methods."""

    def __init__(self, pipeline_group: object = None, num_microbatches: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT()
        # Stands in for the strategy, which attaches the runner after configure_model.
        self._pipeline_group = pipeline_group
        self._num_microbatches = num_microbatches

    def pipeline_blocks(self) -> list[nn.Module]:
        return self.model.pipeline_blocks()

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model.pipeline_loss(output, target)

    def configure_model(self) -> None:
        if self._pipeline_group is not None:
            PipelineRunner(self, group=self._pipeline_group, num_microbatches=self._num_microbatches)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        loss = pipeline_step(self, inputs, target)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        inputs, target = batch
        self.log("val_loss", pipeline_step(self, inputs, target))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)
