"""chemprop's MPNN under ElasticFT3D and under DDPStrategy: fit as chemprop's ``train`` command does, SIGKILL, resume.

Not a test: chemprop is not a dependency of lightning-ft. Install it into a separate venv (docs/lightning-compatibility.md
says how), then, from the repository root. The model, loaders and ``ModelCheckpoint`` are those of chemprop's
``chemprop train`` (``build_dataloader(..., seed=...)``, ``ModelCheckpoint(monitor="val_loss", save_last=True)``,
saved every epoch). chemprop has no resume command; its models train through Lightning's ``Trainer.fit``, so the
resume is Lightning's: ``fit(..., ckpt_path=<dir>/checkpoints/last.ckpt, weights_only=False)`` (the module's
hyperparameters hold chemprop's metric objects, which ``weights_only=True`` refuses under both strategies).
``--kill-at N`` SIGKILLs the last rank after step ``N``; ``--resume`` resumes:

    RUN="python benchmarks/third_party/chemprop_mpnn.py"                # 1 process
    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/chemprop_mpnn.py"
    $RUN fit --dir /tmp/chemprop/straight                 # ElasticFT3D, uninterrupted
    $RUN fit --dir /tmp/chemprop/ddp --strategy ddp       # the oracle
    $RUN fit --dir /tmp/chemprop/killed --kill-at 13      # killed: exits non-zero
    $RUN fit --dir /tmp/chemprop/killed --resume          # fit(ckpt_path=last.ckpt, weights_only=False)
    python benchmarks/third_party/chemprop_mpnn.py compare /tmp/chemprop/straight /tmp/chemprop/killed

The molecules are made here (small chains and rings, a target computed from them); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl  # what chemprop imports
import numpy as np
import torch
from chemprop import data, featurizers, models, nn
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_ft  # noqa: F401 - registers the strategy name "elastic_ft3d"


def molecules() -> tuple[list[str], np.ndarray]:
    smiles = []
    for n in range(1, 9):
        for tail in ("", "O", "N", "F", "Cl", "C(=O)O"):
            smiles += ["C" * n + tail, "C1CCCCC1" + "C" * (n - 1) + tail]
    rng = np.random.default_rng(0)
    y = np.array([[len(s) / 10 + 0.05 * rng.standard_normal()] for s in smiles], dtype=np.float32)
    return smiles, y


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader, nn.UnscaleTransform]:
    smiles, y = molecules()
    points = [data.MoleculeDatapoint.from_smi(s, t) for s, t in zip(smiles, y, strict=True)]
    featurizer = featurizers.SimpleMoleculeMolGraphFeaturizer()
    train, val = data.MoleculeDataset(points[:80], featurizer), data.MoleculeDataset(points[80:], featurizer)
    scaler = train.normalize_targets()
    val.normalize_targets(scaler)
    transform = nn.UnscaleTransform.from_standard_scaler(scaler)
    # As `chemprop train` makes them: a seeded shuffle, batch norm's drop_last.
    train_loader = data.build_dataloader(train, batch_size=8, num_workers=0, seed=0, drop_last=True)
    val_loader = data.build_dataloader(val, batch_size=8, num_workers=0, shuffle=False)
    return train_loader, val_loader, transform


class _StepLog(pl.Callback):
    """Appends each step's loss (rank 0) to ``losses.jsonl``; with ``kill_at``, the last rank SIGKILLs itself after
    that step, once."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory = directory
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
        marker = self.directory / "killed"
        last = trainer.world_size - 1
        if self.kill_at is not None and step == self.kill_at and trainer.global_rank == last and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def fit(args: argparse.Namespace) -> None:
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    train_loader, val_loader, transform = loaders()
    model = models.MPNN(
        nn.BondMessagePassing(d_h=64),
        nn.MeanAggregation(),
        nn.RegressionFFN(input_dim=64, hidden_dim=32, output_transform=transform),
        batch_norm=True,
        metrics=[nn.metrics.RMSE()],
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=args.strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=str(directory),
        callbacks=[
            ModelCheckpoint(directory / "checkpoints", "best-{epoch}", "val_loss", save_last=True),
            _StepLog(directory, args.kill_at),
        ],
    )
    ckpt_path = str(directory / "checkpoints" / "last.ckpt") if args.resume else None
    trainer.fit(model, train_loader, val_loader, ckpt_path=ckpt_path, weights_only=False)
    rank = trainer.global_rank
    report = {"global_step": trainer.global_step, "best": Path(trainer.checkpoint_callback.best_model_path).name}
    if rank == 0:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(weights, directory / "final_weights.pt")
        # chemprop's own load of the best checkpoint, as its `train` command does before predicting.
        best = models.MPNN.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
        report["best_loads"] = sorted(best.state_dict()) == sorted(model.state_dict())
    (directory / f"report-rank{rank}.json").write_text(json.dumps(report))


def compare(args: argparse.Namespace) -> None:
    a = torch.load(Path(args.a) / "final_weights.pt", weights_only=True)
    b = torch.load(Path(args.b) / "final_weights.pt", weights_only=True)
    equal = [k for k in a if torch.equal(a[k], b[k])]
    diff = max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)
    print(f"weights: {len(equal)}/{len(a)} tensors bitwise equal, max abs difference {diff:.3e}")

    def losses(d: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in open(Path(d) / "losses.jsonl"):
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]  # a step run twice (after the resume) keeps its last value
        return out

    la, lb = losses(args.a), losses(args.b)
    same = [s for s in la if s in lb and la[s] == lb[s]]
    print(f"losses: {len(same)}/{len(la)} steps equal; first differing: {[s for s in la if la[s] != lb.get(s)][:3]}")
    ra, rb = (json.loads((Path(d) / "report-rank0.json").read_text()) for d in (args.a, args.b))
    print(f"reports: {ra} / {rb}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--strategy", default="elastic_ft3d")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = parser.parse_args()
    {"fit": fit, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
