"""darts' NBEATSModel under ElasticFT3D and under DDPStrategy: fit, SIGKILL, resume through darts' own path
(``NBEATSModel.load_from_checkpoint(..., best=False)`` then ``fit``), predict.

Not a test: darts is not a dependency of lightning-ft. Install it into a separate venv (docs/lightning-compatibility.md
says how), then, from the repository root. darts makes its own ``pytorch_lightning`` Trainer and gives it its own
``CheckpointIO`` plugin (it allows darts' classes while loading); the strategy is a string in ``pl_trainer_kwargs``
(``"elastic_ft3d"``, which ``import lightning_ft`` registers, or ``"ddp"``, the oracle). darts saves a ``last-{epoch}``
and a ``best-{epoch}-{val_loss}`` checkpoint every epoch. ``--kill-at N`` SIGKILLs the last rank after step ``N``;
``--resume`` then resumes as darts documents it:

    RUN="python benchmarks/third_party/darts_nbeats.py"                 # 1 process
    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/darts_nbeats.py"
    $RUN fit --dir /tmp/darts/straight                  # ElasticFT3D, uninterrupted
    $RUN fit --dir /tmp/darts/ddp --strategy ddp        # the oracle
    $RUN fit --dir /tmp/darts/killed --kill-at 13       # killed: exits non-zero
    $RUN fit --dir /tmp/darts/killed --resume           # darts' load_from_checkpoint(best=False), then fit
    python benchmarks/third_party/darts_nbeats.py compare /tmp/darts/straight /tmp/darts/killed

``fit --predict-error-rank R`` makes darts' ``predict`` after fit raise on rank ``R`` (the case of one rank failing
in predict: every rank must end). The data is synthetic (made here); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl  # what darts imports
import torch
from darts import TimeSeries
from darts.models import NBEATSModel

import lightning_ft.pytorch_lightning  # noqa: F401 - registers the strategy name "elastic_ft3d" with pytorch_lightning

MODEL_NAME = "nbeats"


def make_series() -> tuple[TimeSeries, TimeSeries]:
    rng = np.random.default_rng(0)
    t = np.arange(240, dtype=np.float32)
    values = (np.sin(t / 6) + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
    series = TimeSeries.from_values(values)
    return series[:200], series[176:]


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


def make_model(args: argparse.Namespace) -> NBEATSModel:
    return NBEATSModel(
        input_chunk_length=12,
        output_chunk_length=4,
        num_stacks=2,
        num_blocks=1,
        num_layers=2,
        layer_widths=32,
        n_epochs=args.epochs,
        batch_size=16,
        random_state=0,
        model_name=MODEL_NAME,
        work_dir=str(args.dir),
        save_checkpoints=True,
        force_reset=True,
        pl_trainer_kwargs={
            "accelerator": "cpu",
            "devices": args.devices or int(os.environ.get("WORLD_SIZE", "1")),
            "strategy": args.strategy,
            "enable_progress_bar": False,
            "default_root_dir": str(args.dir),  # lightning-ft's event log goes under it
        },
    )


def fit(args: argparse.Namespace) -> None:
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    train, val = make_series()
    rank = int(os.environ.get("RANK", "0"))
    if args.resume:
        # darts' documented resume: the model and its newest `last-*` checkpoint, then fit (which resumes from it).
        model = NBEATSModel.load_from_checkpoint(MODEL_NAME, work_dir=str(directory), best=False)
    else:
        model = make_model(args)
    # Not in pl_trainer_kwargs: darts pickles those into its model file, which its restricted unpickler then refuses.
    model.trainer_params["callbacks"].append(_StepLog(directory, args.kill_at))
    start = time.perf_counter()
    model.fit(train, val_series=val)
    print(f"rank {rank}: fit ended after {time.perf_counter() - start:.1f} s, epochs trained {model.epochs_trained}")
    report = {"epochs_trained": model.epochs_trained, "global_step": model.trainer.global_step}
    if rank == 0:
        weights = {k: v.detach().clone() for k, v in model.model.state_dict().items()}
        torch.save(weights, directory / "final_weights.pt")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and args.predict_error_rank is None:
        # darts' predict of one series fails on rank 1 at 2 ranks (Lightning's sampler gets no sample there), under
        # DDPStrategy too.
        (directory / f"report-rank{rank}.json").write_text(json.dumps(report))
        return
    if args.predict_error_rank is not None and rank == args.predict_error_rank:
        model.trainer_params["callbacks"].append(_RaiseInPredict())
    start = time.perf_counter()
    try:
        forecast = model.predict(n=4, series=train)
        report["predict"] = [float(v) for v in forecast.values().ravel()]
        print(f"rank {rank}: predict: {report['predict']}")
    finally:
        print(f"rank {rank}: predict ended after {time.perf_counter() - start:.1f} s")
    (directory / f"report-rank{rank}.json").write_text(json.dumps(report))


class _RaiseInPredict(pl.Callback):
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        raise RuntimeError(f"injected error in predict on rank {trainer.global_rank}")


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
    ra, rb = (json.loads((Path(d) / "report-rank0.json").read_text()) for d in (args.a, args.b))
    same = ra.get("predict") == rb.get("predict")
    print(f"epochs trained: {ra['epochs_trained']} and {rb['epochs_trained']}; predict equal: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fit")
    p.add_argument("--dir", required=True)
    p.add_argument("--strategy", default="elastic_ft3d")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--predict-error-rank", type=int, default=None)
    p.add_argument("--devices", type=int, default=None, help="launch by Lightning itself (no torchrun)")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = parser.parse_args()
    {"fit": fit, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
