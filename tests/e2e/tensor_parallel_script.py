"""Lightning's tensor-parallel example (``examples/pytorch/tensor_parallel``) under ``ElasticFT3D``, for
tests/e2e/test_tensor_parallel_example.py: torchrun at dp x tp, tiny dimensions.

The example's files are in tests/e2e/tensor_parallel_example as Lightning ships them: its ``parallelize`` applies tensor
parallelism, and with more than one data-parallel rank wraps every block in ``checkpoint_wrapper`` and FSDP2, so the
parameter names depend on the layout. The LightningModule is the example's ``Llama3`` with two changes: tiny model
dimensions, and ``init_weights()`` in ``on_train_start`` only when training starts at step 0 (the example initializes
at every start, which would overwrite any resumed state, under ``ModelParallelStrategy`` too).

Rank 0 writes ``<out>/start.json`` (the step training starts from) and the full weights (state-dict names, every
DTensor gathered): ``<out>/start.pt`` at ``on_train_start`` and ``<out>/end.pt`` at the end of training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).with_name("tensor_parallel_example")))

from data import RandomTokenDataset  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from parallelism import parallelize  # noqa: E402

from lightning_ft import ElasticFT3D, FaultPolicy  # noqa: E402

VOCAB = 64


class Llama3(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.model_args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=16, max_seq_len=16)
        self.model = Transformer(self.model_args)
        self.out = out

    def configure_model(self) -> None:
        parallelize(self.model, device_mesh=self.device_mesh)

    def on_train_start(self) -> None:
        if self.trainer.global_step == 0:
            self.model.init_weights()
        self._write("start.pt")
        if self.global_rank == 0:
            (self.out / "start.json").write_text(json.dumps({"step": self.trainer.global_step}))

    def on_train_end(self) -> None:
        self._write("end.pt")

    def _write(self, name: str) -> None:
        # Every rank gathers (a collective); rank 0 writes.
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.model.state_dict().items()}
        if self.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in full.items()}, self.out / name)

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        labels = batch[:, 1:]
        output = self.model(inputs)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs) -> None:
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self) -> DataLoader:
        dataset = RandomTokenDataset(vocab_size=VOCAB, seq_length=16)
        return DataLoader(dataset, batch_size=8)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strategy = ElasticFT3D(
        data_parallel_size=args.dp, tensor_parallel_size=args.tp, fault=FaultPolicy(health_checks=False)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=2, save_top_k=-1)],
    )
    L.seed_everything(42)
    with trainer.init_module(empty_init=True):
        model = Llama3(out)
    trainer.fit(model)


if __name__ == "__main__":
    main()
