"""neuralforecast's NHITS (which imports ``pytorch_lightning``) under ElasticFT3D: fit, kill-and-resume, predict, save/load.

Not a test: neuralforecast is not a dependency of lightning-ft. Install it into a separate venv, then, from the
repository root (2 CPU ranks; the first command kills rank 1 after step ``--kill-at``, torchrun fails, the second
command is the same one and resumes by itself):

    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/neuralforecast_nhits.py"
    $RUN fit --dir /tmp/nf/killed --steps 24 --kill-at 13   # exits non-zero
    $RUN fit --dir /tmp/nf/killed --steps 24                # resumes, finishes
    $RUN fit --dir /tmp/nf/straight --steps 24              # uninterrupted
    python benchmarks/third_party/neuralforecast_nhits.py compare /tmp/nf/straight /tmp/nf/killed
    python benchmarks/third_party/neuralforecast_nhits.py load --dir /tmp/nf/killed  # library load + predict, export

The data is synthetic (made here); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytorch_lightning as pl
import torch
from neuralforecast import NeuralForecast
from neuralforecast.models import NHITS
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_ft.pytorch_lightning import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor


def make_frame() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for series in range(4):
        for t in range(80):
            rows.append({"unique_id": f"s{series}", "ds": t, "y": np.sin(t / 5 + series) + rng.normal(0, 0.1)})
    return pd.DataFrame(rows)


class _StepLog(pl.Callback):
    """Appends each step's loss (rank 0) to ``losses.jsonl``; with ``kill_at``, rank 1 dies after that step once."""

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
        if self.kill_at is not None and step == self.kill_at and trainer.global_rank == 1 and not marker.exists():
            marker.touch()
            os._exit(1)


def allow_globals() -> None:
    """What a user must allow for a resume: NHITS keeps its loss (an nn.Module) in its hyperparameters."""
    from neuralforecast.losses.pytorch import MAE

    torch.serialization.add_safe_globals([MAE])


def fit(args: argparse.Namespace) -> None:
    allow_globals()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    model = NHITS(
        h=4,
        input_size=12,
        max_steps=args.steps,
        batch_size=4,
        random_seed=0,
        accelerator="cpu",
        devices=2,
        logger=False,
        default_root_dir=str(directory),  # lightning-ft's event log goes under it
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
    )
    # NHITS stores the Trainer keywords it is given in its hyperparameters, so a strategy and callbacks passed there
    # are pickled into every checkpoint (StragglerMonitor's in-flight collective cannot be): set them afterwards, as
    # neuralforecast's own message suggests (`model.trainer_kwargs[...] = ...`).
    model.trainer_kwargs["strategy"] = ElasticFT3D()
    model.trainer_kwargs["callbacks"] = [
        ModelCheckpoint(dirpath=directory / "checkpoints", every_n_train_steps=args.every, save_last=True),
        StragglerMonitor(),
        ThermalMonitor(),
        GoodputMonitor(),
        _StepLog(directory, args.kill_at),
    ]
    nf = NeuralForecast(models=[model], freq=1)
    nf.fit(make_frame())
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        fitted = nf.models[0]
        torch.save({k: v.detach().clone() for k, v in fitted.state_dict().items()}, directory / "final_weights.pt")
        nf.save(str(directory / "saved"), overwrite=True)
    try:
        forecast = nf.predict()  # the library's predict, with the fit's trainer kwargs (strategy included)
        print(f"rank {rank}: library predict after fit: {forecast.shape}")
    except Exception as e:  # noqa: BLE001 - the result is what this script reports
        print(f"rank {rank}: library predict after fit: {type(e).__name__}: {e}")


def compare(args: argparse.Namespace) -> None:
    a = torch.load(Path(args.a) / "final_weights.pt", weights_only=True)
    b = torch.load(Path(args.b) / "final_weights.pt", weights_only=True)
    equal = [k for k in a if torch.equal(a[k], b[k])]
    diff = max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)
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


def load(args: argparse.Namespace) -> None:
    allow_globals()
    directory = Path(args.dir)
    final = torch.load(directory / "final_weights.pt", weights_only=True)
    nf = NeuralForecast.load(str(directory / "saved"))
    same = all(torch.equal(final[k], v) for k, v in nf.models[0].state_dict().items())
    print(f"library NeuralForecast.load(save): weights equal to the end of fit: {same}")
    # the saved model keeps devices=2, which would start a second process for predict: one process here
    nf.models[0].trainer_kwargs.update(devices=1, strategy="auto")
    forecast = nf.predict(df=make_frame())
    print(
        f"library predict (one process, the loaded model): {forecast.shape}, finite: {bool(forecast['NHITS'].notna().all())}"
    )
    from lightning_ft.pytorch_lightning import load_from_checkpoint

    last = directory / "checkpoints" / "last.ckpt"
    try:
        model = load_from_checkpoint(NHITS, last)
        same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
        print(f"lightning_ft.load_from_checkpoint(NHITS, last.ckpt): weights equal to the end of fit: {same}")
    except Exception as e:  # noqa: BLE001 - the result is what this script reports
        print(f"lightning_ft.load_from_checkpoint(NHITS, last.ckpt): {type(e).__name__}: {e}")
    # `lightning-ft export` as a command (told the loss class), then the library's Lightning load of that file and its
    # predict with those weights in place of the saved model's.
    cli = Path(sys.executable).with_name("lightning-ft")  # the console script of the venv running this
    exported = directory / "exported.ckpt"
    done = subprocess.run(
        [
            str(cli),
            "export",
            "--no-progress",
            "--safe-globals",
            "neuralforecast.losses.pytorch:MAE",
            str(last),
            str(exported),
        ],
        capture_output=True,
        text=True,
    )
    print(f"`lightning-ft export --safe-globals neuralforecast.losses.pytorch:MAE`: exit code {done.returncode}")
    model = NHITS.load_from_checkpoint(exported)
    same = all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    print(f"library NHITS.load_from_checkpoint(export): weights equal to the end of fit: {same}")
    model.trainer_kwargs.update(devices=1, strategy="auto")
    nf.models[0] = model
    again = nf.predict(df=make_frame())
    print(f"library predict with the exported weights: equal to the saved model's: {again.equals(forecast)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("load")
    p.add_argument("--dir", required=True)
    args = parser.parse_args()
    {"fit": fit, "compare": compare, "load": load}[args.cmd](args)


if __name__ == "__main__":
    main()
