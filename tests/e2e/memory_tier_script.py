"""A small training run for the memory-tier end-to-end tests, launched under real torchrun (one or several agents).

Faults come from ``--faults`` (a :meth:`lightning_ft.fault.FaultInjector.from_spec` string, per attempt); the memory
folder from ``LIGHTNING_FT_MEMORY_DIR`` (one per simulated node). Every rank writes its final weights to
``<out>/weights_rank<r>.pt`` when ``fit`` returns, for a bitwise comparison with an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.gpt import GPT, SyntheticTokens  # noqa: E402
from lightning_ft import ElasticFT3D, FaultPolicy, MemoryTier  # noqa: E402
from lightning_ft.fault import FaultInjector  # noqa: E402


class HoldAfter(Callback):
    """Pause after each batch from step ``step`` on while ``file`` exists (the test kills a node meanwhile)."""

    def __init__(self, file: str, step: int) -> None:
        self.file, self.step = file, step

    def on_train_batch_end(self, trainer, *args) -> None:
        import time

        while self.file and trainer.global_step >= self.step and os.path.exists(self.file):
            time.sleep(0.2)


class SettleMemoryAt(Callback):
    """Before step ``step`` (where the test's kill fires), wait until the memory save in flight is committed on every
    rank, so that the kill finds a known memory step. Without it the kill can land in the middle of a memory save;
    the resume then agrees on the older step (or the durable tier), which the unit tests cover."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        memory = trainer.strategy._memory
        if trainer.global_step == self.step and memory is not None:
            memory.wait()


class CountBatches(Callback):
    """A stateful callback that counts the batches in ``on_train_batch_end`` (as a user's metric or EMA would): a
    restored run must count each committed batch once, so its count at the end is the uninterrupted run's."""

    def __init__(self) -> None:
        self.seen = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state_dict) -> None:
        self.seen = state_dict["seen"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=14)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--memory-every", type=int, default=0, help="0: no memory tier")
    p.add_argument("--faults", default="")
    p.add_argument("--hold-file", default="")
    p.add_argument("--hold-step", type=int, default=0)
    p.add_argument("--settle-at", type=int, default=-1, help="wait for the memory save in flight before this step")
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(1234)
    injector = FaultInjector.from_spec(args.faults)
    tier = MemoryTier(every_n_train_steps=args.memory_every) if args.memory_every else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(fault=FaultPolicy(health_checks=False), memory_tier=tier),
        max_steps=args.max_steps,
        default_root_dir=args.root,
        logger=False,
        callbacks=[
            ModelCheckpoint(dirpath=Path(args.root) / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1),
            SettleMemoryAt(args.settle_at),
            injector,
            HoldAfter(args.hold_file, args.hold_step),
            counter := CountBatches(),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    model = GPT(vocab_size=64, dim=32, n_heads=4, n_layers=2, seq_len=16)
    data = SyntheticTokens(256, seq_len=16, vocab_size=64)
    trainer.fit(model, train_dataloaders=DataLoader(injector.wrap_dataset(data), batch_size=8, shuffle=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"weights_rank{trainer.global_rank}.pt"
    )
    (out / f"batches_rank{trainer.global_rank}.txt").write_text(str(counter.seen))


if __name__ == "__main__":
    main()
