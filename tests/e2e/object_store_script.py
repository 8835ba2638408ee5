"""A 2-rank ElasticFT3D run whose ModelCheckpoint dirpath is an object-store URL, for tests/e2e/test_object_store.py.

``memory://`` is private to each process, so the ranks share a fake bucket instead: ``sharedbucket://`` is fsspec's
local filesystem under ``--bucket`` (a folder all ranks see) with an object store's limits: no rename, move, copy or
link. Every rank registers it before Lightning resolves the dirpath. Rank 0 writes the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import fsspec
import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PROTOCOL = "sharedbucket"


class SharedBucket(LocalFileSystem):
    """``sharedbucket://key`` is the file ``$LFT_TEST_BUCKET/key``; rename, move, copy and link are refused."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(auto_mkdir=True)

    @classmethod
    def _root(cls) -> str:
        return os.environ["LFT_TEST_BUCKET"].rstrip("/")

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(cls._root()):
            return path.rstrip("/") or "/"
        return f"{cls._root()}/{path.removeprefix(f'{PROTOCOL}://').lstrip('/')}".rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{str(name).removeprefix(self._root()).lstrip('/')}"

    def _refused(self, *args, **kwargs):
        raise NotImplementedError("an object store has no rename, move, copy or link")

    mv = rename = copy = cp_file = link = symlink = _refused


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ["LFT_TEST_BUCKET"] = args.bucket
    fsspec.register_implementation(PROTOCOL, SharedBucket, clobber=True)

    from lightning_ft import ElasticFT3D

    torch.set_num_threads(1)
    L.seed_everything(7)
    ckpt = ModelCheckpoint(
        dirpath=f"{PROTOCOL}://ckpt", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(),
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        callbacks=[ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    model = Regressor()
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
    if trainer.global_rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save({"weights": model.state_dict(), "step": trainer.global_step}, Path(args.out) / "final.pt")


if __name__ == "__main__":
    main()
