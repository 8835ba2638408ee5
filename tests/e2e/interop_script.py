"""One training run under DDPStrategy, ModelParallelStrategy or ElasticFT3D, for the interoperability tests.

Launched under real torchrun. With ``--fsdp`` the module shards its layers over the data-parallel mesh axis in
``configure_model()`` (FSDP2), as a ModelParallelStrategy user's module does. At the end every rank takes part in
gathering the full weights and optimizer state; rank 0 writes them to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ShardedRegressor(L.LightningModule):
    def __init__(self, fsdp: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def configure_model(self) -> None:
        if self.hparams.fsdp and self.device_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "modelparallel", "elasticft"], required=True)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(7)
    if args.strategy == "elasticft":
        from lightning_ft import ElasticFT3D

        strategy = ElasticFT3D()
    elif args.strategy == "modelparallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
    else:
        strategy = "ddp"
    ckpt = ModelCheckpoint(dirpath=Path(args.root) / args.strategy, every_n_train_steps=args.ckpt_every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        callbacks=[ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = ShardedRegressor(fsdp=args.fsdp)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path=args.ckpt_path)

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    module = trainer.lightning_module
    weights = {k: _full(v).detach().clone() for k, v in module.state_dict().items()}
    optimizer = trainer.optimizers[0]
    optim = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))
    optim_state = {name: {k: _full(v).clone() for k, v in s.items()} for name, s in optim["state"].items()}
    if trainer.global_rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        torch.save({"weights": weights, "optim": optim_state, "step": trainer.global_step, "lr": lr}, out / "final.pt")


if __name__ == "__main__":
    main()
