"""A small training run for the fault tests, launched under real torchrun; faults come from ``--faults``.

``--faults`` is a :meth:`lightning_ft.fault.FaultInjector.from_spec` string; faults carry the attempt they fire on, so
one torchrun with ``--max-restarts`` can go through several faults in a row. ``--ecc-at RANK:STEP`` gives the health
checks a ``FakeNVML`` (the CPU has no NVML) whose device reports uncorrected ECC errors on ``RANK`` from the start of
step ``STEP``. Rank 0 writes the final step to ``<root>/done.json`` when ``fit`` returns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.gpt import GPT, SyntheticTokens  # noqa: E402
from lightning_ft import ElasticFT3D, FaultPolicy  # noqa: E402
from lightning_ft.fault import FaultInjector  # noqa: E402
from lightning_ft.nvml import FakeNVML  # noqa: E402


class GPTWithValidation(GPT):
    def validation_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)


class EccErrorAt(Callback):
    """From the start of step ``step`` on rank ``rank``, the fake NVML device reads 2 uncorrected ECC errors."""

    def __init__(self, nvml: FakeNVML, rank: int, step: int) -> None:
        self.nvml, self.rank, self.step = nvml, rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            print(f"[fault] NVML reports 2 uncorrected ECC errors at rank {self.rank}, step {self.step}", flush=True)
            self.nvml.set(0, ecc_uncorrected=2.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--faults", default="")
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint dirpath (default: <root>/ckpt)")
    p.add_argument("--hang-timeout", type=float, default=600.0)
    p.add_argument("--first-step-timeout", type=float, default=1800.0)
    p.add_argument("--grace", type=float, default=25.0)
    p.add_argument("--val-every", type=int, default=0, help="validation every N training batches (0: none)")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--no-health-checks", action="store_true")
    p.add_argument("--health-every", type=int, default=None, help="FaultPolicy.health_check_every_n_steps")
    p.add_argument("--health-action", default="log", help="FaultPolicy.health_check_action")
    p.add_argument("--health-slowdown", type=float, default=5.0, help="FaultPolicy.health_check_slowdown")
    p.add_argument("--ecc-at", default=None, help="RANK:STEP: the fake NVML reports ECC errors there")
    p.add_argument("--checkpoint-format", default="auto", help="ElasticFT3D(checkpoint_format=...); the user's default")
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(1234)
    root = Path(args.root)
    injector = FaultInjector.from_spec(args.faults)
    fault = FaultPolicy(
        hang_timeout_s=args.hang_timeout,
        first_step_timeout_s=args.first_step_timeout,
        grace_s=args.grace,
        health_checks=not args.no_health_checks,
        health_check_every_n_steps=args.health_every,
        health_check_action=args.health_action,
        health_check_slowdown=args.health_slowdown,
    )
    strategy = ElasticFT3D(fault=fault, checkpoint_format=args.checkpoint_format)
    extra = []
    if args.ecc_at:
        rank, step = (int(v) for v in args.ecc_at.split(":"))
        nvml = FakeNVML(device_count=1)
        strategy._fault.nvml = nvml  # the health checks' NVML seam (a test's FakeNVML; a CPU has no real one)
        extra.append(EccErrorAt(nvml, rank, step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_steps=args.max_steps,
        default_root_dir=root,
        logger=False,
        callbacks=[
            ModelCheckpoint(dirpath=args.ckpt_dir or root / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1),
            injector,
            *extra,
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        val_check_interval=args.val_every or None,
        limit_val_batches=3 if args.val_every else 0,
        num_sanity_val_steps=0,
    )
    model = GPTWithValidation(vocab_size=64, dim=32, n_heads=4, n_layers=2, seq_len=16)
    data = SyntheticTokens(args.samples, seq_len=16, vocab_size=64)
    train = DataLoader(injector.wrap_dataset(data), batch_size=8, shuffle=True)
    val = DataLoader(SyntheticTokens(64, seq_len=16, vocab_size=64, seed=7), batch_size=8) if args.val_every else None
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    if trainer.global_rank == 0:
        (root / "done.json").write_text(json.dumps({"step": trainer.global_step}))
        torch.save(model.state_dict(), root / "final_weights.pt")


if __name__ == "__main__":
    main()
