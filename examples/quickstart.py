# examples/quickstart.py: torchrun --standalone --nproc-per-node=2 examples/quickstart.py (CPU or GPUs)
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor


class Regressor(L.LightningModule):  # your own LightningModule: nothing in it changes
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)


if __name__ == "__main__":
    trainer = L.Trainer(
        strategy=ElasticFT3D(),  # data parallel; tensor_parallel_size=..., pipeline_parallel_size=... for 3D
        max_steps=40,
        log_every_n_steps=5,
        callbacks=[
            ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=10, save_last=True),
            StragglerMonitor(),
            ThermalMonitor(),
            GoodputMonitor(),
        ],
    )
    trainer.fit(Regressor())  # after a crash, or a restart at another world size, the same call resumes
