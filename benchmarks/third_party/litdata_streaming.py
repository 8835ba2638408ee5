"""litData's ``StreamingDataset`` + ``StreamingDataLoader`` under ElasticFT3D: kill-and-resume at the same world size
(bitwise) and on another world size (litData's elastic resume: every sample of the epoch once).

Not a test: litData's install pulls torchvision, whose PyPI build for torch 2.13 is a CUDA one that breaks
``import lightning`` next to the CPU torch CI installs (torchmetrics imports it). Install it into a separate venv
and remove torchvision again (litData needs it only for images and video):

    python3 -m venv /tmp/venv-litdata && /tmp/venv-litdata/bin/pip install torch==2.13.0
    /tmp/venv-litdata/bin/pip install litdata torch==2.13.0 && /tmp/venv-litdata/bin/pip uninstall -y torchvision
    /tmp/venv-litdata/bin/pip install -e . --no-deps && /tmp/venv-litdata/bin/pip install -e .

Then, from the repository root, ``python benchmarks/third_party/litdata_streaming.py all --work /tmp/litdata-ft``
runs everything below and prints one line per check (exit code 1 if one fails). Step by step:

    python benchmarks/third_party/litdata_streaming.py data --data /tmp/ld/data     # litdata.optimize, 64 samples
    RUN="python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/third_party/litdata_streaming.py"
    $RUN fit --data /tmp/ld/data --dir /tmp/ld/straight --steps 12
    $RUN fit --data /tmp/ld/data --dir /tmp/ld/killed --steps 12 --kill-at 7      # exits non-zero
    $RUN fit --data /tmp/ld/data --dir /tmp/ld/killed --steps 12                  # resumes from step 6
    python benchmarks/third_party/litdata_streaming.py compare /tmp/ld/straight /tmp/ld/killed

The run: 64 samples in chunks of 8, ``StreamingDataset(shuffle=True, seed=7)``, ``StreamingDataLoader(batch_size=4,
num_workers=1)``, 2 ranks, so an epoch is 8 steps; checkpoints every 3 steps; the kill at step 7 leaves step 6
(mid-epoch) as the newest committed checkpoint; 12 steps cross into the second epoch. The loader's ``state_dict`` goes
through the checkpoint as Lightning saves it (``loops.fit_loop.state_dict.combined_loader``).
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

from lightning_ft import ElasticFT3D, ElasticPolicy, GoodputMonitor, StragglerMonitor, ThermalMonitor

SAMPLES, CHUNK, BATCH, FEATURES = 64, 8, 4, 8


def make_sample(index: int) -> dict:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=g)
    return {"index": index, "x": x, "y": x.sum().unsqueeze(0)}


def make_data(directory: Path) -> None:
    import litdata

    litdata.optimize(
        fn=make_sample, inputs=list(range(SAMPLES)), output_dir=str(directory), chunk_size=CHUNK, num_workers=1
    )


class Regressor(L.LightningModule):
    def __init__(self, data: str, workers: int) -> None:
        super().__init__()
        self.data, self.workers = data, workers
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        # Made here, after the process group is up: litData reads the rank from it when the dataset is created (from
        # the environment before, where torchrun's RANK is not the GLOBAL_RANK it looks for, so every rank would read
        # rank 0's share). drop_last=True as litData picks by itself on several ranks: on one it would pick False and
        # refuse the saved state.
        dataset = StreamingDataset(input_dir=self.data, shuffle=True, seed=7, drop_last=True)
        return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=self.workers)


class Record(Callback):
    """Per rank: the sample indices of every batch (``samples_rank<r>.jsonl``); rank 0: the global mean loss of every
    step (``losses.jsonl``). With ``kill_at``, every rank exits hard after that step, once the checkpoint in flight is
    committed."""

    def __init__(self, directory: Path, kill_at: int | None) -> None:
        self.directory, self.kill_at = directory, kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        with open(self.directory / f"samples_rank{trainer.global_rank}.jsonl", "a") as f:
            fields = {"step": step, "epoch": trainer.current_epoch, "world": trainer.world_size}
            f.write(json.dumps({**fields, "ids": batch["index"].tolist()}) + "\n")
        loss = outputs["loss"].detach().clone() * trainer.accumulate_grad_batches
        torch.distributed.all_reduce(loss)
        if trainer.global_rank == 0:
            with open(self.directory / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": float(loss) / trainer.world_size}) + "\n")
        if self.kill_at is not None and step == self.kill_at:
            trainer.strategy.checkpoint_wait()
            os._exit(17)


def fit(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(1234)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ElasticFT3D(elastic=ElasticPolicy(batch="keep_global")) if args.strategy == "elasticft" else "ddp",
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
            Record(directory, args.kill_at),
        ],
    )
    trainer.fit(Regressor(str(Path(args.data).resolve()), args.workers), ckpt_path=args.ckpt_path)
    if trainer.global_rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}, directory / "w.pt"
        )


def _read(directory: Path) -> tuple[dict[str, torch.Tensor], dict[int, float], dict[int, dict[int, list[int]]]]:
    weights = torch.load(directory / "w.pt", weights_only=True)
    losses: dict[int, float] = {}
    for line in (directory / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]  # a resumed attempt's lines replace the killed one's
    samples: dict[int, dict[int, list[int]]] = {}  # step -> rank -> ids, the last attempt's
    for rank, file in enumerate(sorted(directory.glob("samples_rank*.jsonl"))):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            samples.setdefault(record["step"], {})[rank] = record["ids"]
    return weights, losses, samples


def _resumed(directory: Path) -> list[dict]:
    from lightning_ft.events import read_events

    return [e for e in read_events(directory) if e["event"] == "resumed"]


def compare(straight: Path, killed: Path) -> list[str]:
    """Failures of the resumed run against the uninterrupted one (empty: bitwise equal)."""
    w0, l0, s0 = _read(straight)
    w1, l1, s1 = _read(killed)
    failures = [f"weights differ: {name}" for name in w0 if not torch.equal(w0[name], w1[name])]
    failures += [f"loss differs at step {step}" for step in l0 if l0[step] != l1.get(step)]
    overlap = [step for step, ranks in s0.items() if len(ranks) > 1 and set(ranks[0]) & set(ranks[1])]
    failures += [f"the ranks read the same samples at steps {overlap}"] if overlap else []
    resumed_from = [e["step"] for e in _resumed(killed)]
    failures += [
        f"samples differ at step {step}" for step in s0 if step > max(resumed_from, default=0) and s0[step] != s1[step]
    ]
    print(
        f"compare: resumed from {resumed_from}; {len(w0) - sum('weights' in f for f in failures)}/{len(w0)} weight"
        f" tensors bitwise equal; {len(l0) - sum('loss' in f for f in failures)}/{len(l0)} step losses equal;"
        f" samples of {len([s for s in s0 if s > max(resumed_from, default=0)])} steps after the resume compared"
    )
    return failures


def elastic_check(directory: Path, resume_step: int, epoch_steps_before: int) -> list[str]:
    """After a 2-rank run killed mid-epoch resumes on 1 rank: the first epoch's samples, those before the resumed
    checkpoint on 2 ranks plus those after it on 1, are each of the 64 once."""
    seen: list[int] = []
    for file in sorted(directory.glob("samples_rank*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            before = record["world"] == 2 and record["step"] <= resume_step
            after = record["world"] == 1 and record["epoch"] == 0
            if before or after:
                seen += record["ids"]
    failures = []
    if sorted(seen) != list(range(SAMPLES)):
        dupes = len(seen) - len(set(seen))
        failures.append(f"epoch 0: {len(seen)} samples seen, {dupes} twice, {SAMPLES - len(set(seen))} missing")
    print(f"elastic: epoch 0 saw {len(seen)} samples, {len(set(seen))} distinct, of {SAMPLES}")
    return failures


def run_all(work: Path, workers: int) -> int:
    if work.exists():
        shutil.rmtree(work)
    data = work / "data"
    make_data(data)
    script = str(Path(__file__).resolve())

    def torchrun(nproc: int, *args: str) -> int:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
        cmd += ["fit", "--data", str(data), "--workers", str(workers), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode not in (0, 17) and "exitcode  : 17" not in proc.stderr:
            print(proc.stderr[-4000:])
        return proc.returncode

    failures = []
    steps = ["--steps", "12"]
    if torchrun(2, "--dir", str(work / "straight"), *steps):
        return 1
    if torchrun(2, "--dir", str(work / "killed"), *steps, "--kill-at", "7") == 0:
        failures.append("the kill at step 7 did not happen")
    if torchrun(2, "--dir", str(work / "killed"), *steps):
        return 1
    failures += compare(work / "straight", work / "killed")
    # Another world size: killed at step 7 on 2 ranks, resumed from step 6 on 1 (keep_global: accumulation 2).
    if torchrun(2, "--dir", str(work / "elastic"), *steps, "--kill-at", "7") == 0:
        failures.append("the kill at step 7 did not happen")
    if torchrun(1, "--dir", str(work / "elastic"), *steps):
        return 1
    (event,) = _resumed(work / "elastic")
    print(
        f"elastic: resumed from step {event['step']}, world {event['saved_world_size']} -> {event['world_size']},"
        f" accumulate_grad_batches {event['accumulate_grad_batches']}"
    )
    failures += elastic_check(work / "elastic", resume_step=event["step"], epoch_steps_before=8)
    for failure in failures:
        print("FAIL:", failure)
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--data", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--data", required=True)
    f.add_argument("--dir", required=True)
    f.add_argument("--steps", type=int, default=12)
    f.add_argument("--kill-at", type=int, default=None)
    f.add_argument("--workers", type=int, default=1)
    f.add_argument("--strategy", choices=["elasticft", "ddp"], default="elasticft", help="ddp: Lightning's, to compare")
    f.add_argument("--ckpt-path", default=None, help="with --strategy ddp: the checkpoint to resume from")
    c = sub.add_parser("compare")
    c.add_argument("straight")
    c.add_argument("killed")
    a = sub.add_parser("all")
    a.add_argument("--work", required=True)
    a.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    if args.cmd == "data":
        make_data(Path(args.data))
    elif args.cmd == "fit":
        fit(args)
    elif args.cmd == "compare":
        sys.exit(1 if compare(Path(args.straight), Path(args.killed)) else 0)
    else:
        sys.exit(run_all(Path(args.work), args.workers))


if __name__ == "__main__":
    main()
