"""Time from launch to the first step after a resume: ElasticFT3D's auto-resume against Lightning's own resume.

Each contender trains the model of ``benchmarks/checkpoint_cost.py`` (``--size-mb`` of weights plus Adam state) for a
few steps under ``torchrun --nproc_per_node 2`` and saves at the last step; then a second ``torchrun`` resumes and
trains two more steps. Timed in the second launch: from the moment the driver starts ``torchrun`` to the end of the
first step after the resume (interpreter start, imports, process groups, Lightning set-up, the load, one step).

- ``ft3d``: ``ElasticFT3D`` resumes from the committed checkpoint by itself (auto-resume);
- ``lightning``: ``DDPStrategy``, ``trainer.fit(ckpt_path=<the .ckpt file>)``: ``torch.load`` of the same state plus
  Lightning's set-up, the baseline.

Repetitions are interleaved. Run: ``python benchmarks/resume_time.py [--size-mb 350] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN = 2048
BATCH = 16
STEPS = 3


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import ElasticFT3D

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = max(1, round(args.size_mb * 1e6 / (3 * 4 * HIDDEN * HIDDEN)))

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-6)

    class FirstStep(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if not hasattr(self, "at"):
                self.at = time.time()

    run_dir = Path(args.run_dir)
    resume = args.phase == "resume"
    first = FirstStep()
    ckpt = ModelCheckpoint(dirpath=run_dir / "ckpt", every_n_train_steps=STEPS, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ElasticFT3D() if args.contender == "ft3d" else DDPStrategy(),
        max_steps=STEPS + (2 if resume else 0),
        callbacks=[first, ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )
    data = DataLoader(TensorDataset(torch.randn(BATCH * 2 * (STEPS + 3), HIDDEN)), batch_size=BATCH)
    ckpt_path = None
    if resume and args.contender == "lightning":
        ckpt_path = str(next((run_dir / "ckpt").glob("*.ckpt")))
    trainer.fit(Net(), data, ckpt_path=ckpt_path)
    if resume and trainer.global_rank == 0:
        launched = float(os.environ["BENCH_LAUNCH_TIME"])
        print("RESULT " + json.dumps({"first_step_s": first.at - launched}), flush=True)


def launch(args: argparse.Namespace, contender: str, phase: str, run_dir: Path) -> float | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        __file__, "--worker", "--contender", contender, "--phase", phase, "--run-dir", str(run_dir),
        "--size-mb", str(args.size_mb),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_LAUNCH_TIME": repr(time.time())}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{contender} {phase} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return results[0]["first_step_s"] if results else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=350.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    times: dict[str, list[float]] = {"ft3d": [], "lightning": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.repeats):
            for contender in times:
                run_dir = Path(tmp) / f"{contender}-{rep}"
                launch(args, contender, "train", run_dir)
                result = launch(args, contender, "resume", run_dir)
                assert result is not None
                times[contender].append(result)
                print(f"  [{rep + 1}/{args.repeats}] {contender}: {result:.2f} s", flush=True)
    ft3d, base = statistics.median(times["ft3d"]), statistics.median(times["lightning"])
    print(f"\nstate {args.size_mb:.0f} MB, 2 ranks, median of {args.repeats}; load average at start {load}")
    print("| contender | launch to first step after resume s |\n|---|---|")
    print(f"| ElasticFT3D (auto-resume) | {ft3d:.2f} |\n| DDPStrategy + torch.load (ckpt_path) | {base:.2f} |")
    print(f"ratio ElasticFT3D / torch.load baseline: {ft3d / base:.2f} (goal <= 1.1)")


if __name__ == "__main__":
    main()
