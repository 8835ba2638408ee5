"""lightly's SimCLR (its transform, projection head and NT-Xent loss, in a LightningModule as lightly's own examples
write it) under ElasticFT3D: fit, kill-and-resume, predict, save/load.

Not a test: lightly needs torchvision, whose PyPI build is a CUDA one, so it runs beside the CUDA build of torch
(which also runs on CPU), about 6 GB: far more than CI's install. In a separate venv, from the repository root:

    python3 -m venv /tmp/venv-lightly
    /tmp/venv-lightly/bin/pip install torch==2.14.1 torchvision==0.29.1
    /tmp/venv-lightly/bin/pip install lightly torch==2.14.1 torchvision==0.29.1 && /tmp/venv-lightly/bin/pip install -e .
    /tmp/venv-lightly/bin/python benchmarks/third_party/lightly_simclr.py all --work /tmp/lightly-ft

``all`` runs an uninterrupted 12-step fit, the same fit killed after step 7 (every rank ``os._exit``, once the
checkpoint in flight is committed; step 6 is the newest), the same command again (it resumes by itself), compares
weights and per-step losses bitwise, then loads the result (``load``) and prints one line per check. The data is
torchvision's ``FakeData`` (64 images of 32x32, made from their index), through lightly's ``LightlyDataset`` and
``SimCLRTransform`` (random crops, flips, colour jitter, blur, in the main process: the resume must restore the RNG
streams for the augmentations to match).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_ft import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor

IMAGES, BATCH = 64, 8  # 4 steps an epoch on 2 ranks


def make_dataset():
    import torchvision
    from lightly.data import LightlyDataset
    from lightly.transforms.simclr_transform import SimCLRTransform

    fake = torchvision.datasets.FakeData(size=IMAGES, image_size=(3, 32, 32), num_classes=4, random_offset=0)
    return LightlyDataset.from_torch_dataset(fake, transform=SimCLRTransform(input_size=32, gaussian_blur=0.5))


class SimCLR(L.LightningModule):
    def __init__(self, lr: float = 0.06) -> None:
        super().__init__()
        from lightly.loss import NTXentLoss
        from lightly.models.modules import SimCLRProjectionHead

        self.save_hyperparameters()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.projection_head = SimCLRProjectionHead(32, 32, 16)
        self.criterion = NTXentLoss(gather_distributed=True)

    def forward(self, x):
        return self.projection_head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        (x0, x1), _, _ = batch
        return self.criterion(self(x0), self(x1))

    def predict_step(self, batch, batch_idx):
        (x0, _), _, _ = batch
        return self.backbone(x0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class StepLog(Callback):
    """Rank 0 appends every step's loss to ``losses.jsonl``; with ``kill_at`` every rank exits hard after that step,
    once the checkpoint in flight is committed."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory, self.kill_at = directory, kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            trainer.strategy.checkpoint_wait()
            os._exit(17)


def fit(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    L.seed_everything(1234)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(),
        max_steps=args.steps,
        default_root_dir=directory,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        callbacks=[
            ModelCheckpoint(dirpath=directory / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True),
            StragglerMonitor(),
            ThermalMonitor(),
            GoodputMonitor(),
            StepLog(directory, args.kill_at),
        ],
    )
    model = SimCLR()
    loader = DataLoader(make_dataset(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(model, train_dataloaders=loader)
    weights = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
    embeddings = trainer.predict(model, dataloaders=DataLoader(make_dataset(), batch_size=BATCH))
    trainer.save_checkpoint(directory / "final.ckpt")  # collective
    if trainer.global_rank == 0:
        torch.save(weights, directory / "w.pt")
        shape = (sum(e.shape[0] for e in embeddings), embeddings[0].shape[1])
        (directory / "predict.json").write_text(json.dumps({"shape": shape}))


def compare(straight: Path, killed: Path) -> list[str]:
    w0, w1 = (torch.load(d / "w.pt", weights_only=True) for d in (straight, killed))

    def losses(d: Path) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in (d / "losses.jsonl").read_text().splitlines():
            record = json.loads(line)
            out[record["step"]] = record["loss"]  # the resumed attempt's lines replace the killed one's
        return out

    l0, l1 = losses(straight), losses(killed)
    failures = [f"weights differ: {k}" for k in w0 if not torch.equal(w0[k], w1[k])]
    failures += [f"loss differs at step {s}" for s in l0 if l0[s] != l1.get(s)]
    from lightning_ft.events import read_events

    resumed = [e["step"] for e in read_events(killed) if e["event"] == "resumed"]
    print(
        f"compare: resumed from {resumed}; {len(w0) - sum('weights' in f for f in failures)}/{len(w0)} weight tensors"
        f" bitwise equal; {len(l0) - sum('loss' in f for f in failures)}/{len(l0)} step losses equal"
    )
    return failures + ([] if resumed == [6] else [f"resumed from {resumed}, not [6]"])


def load(directory: Path) -> list[str]:
    from lightning_ft import load_from_checkpoint

    failures = []
    final = torch.load(directory / "w.pt", weights_only=True)
    shape = json.loads((directory / "predict.json").read_text())["shape"]
    print(f"trainer.predict after fit on 2 ranks: rank 0 embedded its {shape[0]} images into {shape[1]} dimensions")
    model = load_from_checkpoint(SimCLR, directory / "final.ckpt")
    same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    print(f"lightning_ft.load_from_checkpoint(SimCLR, final.ckpt): weights equal to the end of fit: {same}")
    failures += [] if same else ["load_from_checkpoint: weights differ"]
    exported = directory / "exported.ckpt"
    cmd = [sys.executable, "-m", "lightning_ft.cli", "export", "--no-progress", str(directory / "final.ckpt")]
    subprocess.run([*cmd, str(exported)], check=True, capture_output=True)
    plain = SimCLR.load_from_checkpoint(exported, weights_only=True)
    same = all(torch.equal(final[k], v) for k, v in plain.state_dict().items())
    print(f"lightning-ft export + SimCLR.load_from_checkpoint (Lightning's): weights equal: {same}")
    failures += [] if same else ["export + load_from_checkpoint: weights differ"]
    model.eval(), plain.eval()  # BatchNorm: the running statistics, on both
    with torch.no_grad():
        x = torch.randn(2, 3, 32, 32)
        same = torch.equal(model.backbone(x), plain.backbone(x))
    print(f"the two loaded models embed alike: {same}")
    return failures + ([] if same else ["the two loaded models embed differently"])


def run_all(work: Path) -> int:
    if work.exists():
        shutil.rmtree(work)
    script = str(Path(__file__).resolve())

    def torchrun(*args: str) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, "fit"]
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True)
        if proc.returncode and "exitcode  : 17" not in proc.stderr:
            print(proc.stderr[-4000:])
        return proc.returncode

    failures = []
    steps = ["--steps", "12"]
    if torchrun("--dir", str(work / "straight"), *steps):
        return 1
    if torchrun("--dir", str(work / "killed"), *steps, "--kill-at", "7") == 0:
        failures.append("the kill at step 7 did not happen")
    if torchrun("--dir", str(work / "killed"), *steps):
        return 1
    failures += compare(work / "straight", work / "killed")
    failures += load(work / "killed")
    for failure in failures:
        print("FAIL:", failure)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--dir", required=True)
    f.add_argument("--steps", type=int, default=12)
    f.add_argument("--kill-at", type=int, default=None)
    c = sub.add_parser("compare")
    c.add_argument("straight")
    c.add_argument("killed")
    d = sub.add_parser("load")
    d.add_argument("--dir", required=True)
    a = sub.add_parser("all")
    a.add_argument("--work", required=True)
    args = p.parse_args()
    if args.cmd == "fit":
        fit(args)
    elif args.cmd == "compare":
        sys.exit(1 if compare(Path(args.straight), Path(args.killed)) else 0)
    elif args.cmd == "load":
        sys.exit(1 if load(Path(args.dir)) else 0)
    else:
        sys.exit(run_all(Path(args.work)))


if __name__ == "__main__":
    main()
