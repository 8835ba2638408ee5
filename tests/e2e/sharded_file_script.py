"""torchrun entry: :class:`RowShardedNet` under ``ElasticFT3D(tensor_parallel_size=2)``, checkpoints every
``--ckpt-every`` steps; every rank saves its full weights to ``--out`` at the end. ``--kill-at-step`` ends every rank
with ``os._exit`` after that step (once the checkpoint in flight is committed)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_ft import ElasticFT3D  # noqa: E402
from tests.e2e.sharded_file_model import RowShardedNet  # noqa: E402


class HardExitAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_wait()
            os._exit(17)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plan", default="rows")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--checkpoint-format", default="file")
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(1234)
    root = Path(args.root)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1)
    ]
    if args.kill_at_step:
        callbacks.append(HardExitAt(args.kill_at_step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(tensor_parallel_size=2, checkpoint_format=args.checkpoint_format),
        max_steps=args.max_steps,
        default_root_dir=root,
        logger=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RowShardedNet(plan=args.plan))
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in trainer.lightning_module.state_dict().items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / f"weights_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
