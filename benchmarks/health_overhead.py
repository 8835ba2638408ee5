"""Cost of the periodic health checks (``FaultPolicy.health_check_every_n_steps``) on a CPU gloo run, paired.

One Lightning run under ``ElasticFT3D`` (gloo, ``--ranks`` processes, a tiny model whose step takes ~20 ms) with the
periodic checks every ``--every`` steps (10 by default, to collect many checks in one run). Each step that ends in a
check is paired with the step just before it, in the same processes, so the machine's load is the same for both:
the cost of one check is their difference (the median over the pairs). The overhead at the default interval (1000
steps) is that cost over 1000 plain steps; the end-to-end ratio of steps with and without a check is printed too.

Run: ``python benchmarks/health_overhead.py [--ranks 2] [--steps 400] [--every 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEP_MS = 20.0
WARMUP = 20
DEFAULT_EVERY = 1000  # FaultPolicy().health_check_every_n_steps


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import ElasticFT3D, FaultPolicy

    torch.set_num_threads(1)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(STEP_MS / 1000.0)  # stands in for device compute: the host waits
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(Callback):
        """Start of every step: a step's time runs to the next start, so it holds the check at its end."""

        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

    timer = StepTimer()
    fault = FaultPolicy(health_check_every_n_steps=args.every)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.ranks,
        strategy=ElasticFT3D(fault=fault),
        max_steps=args.steps,
        default_root_dir=args.root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    n = args.steps * args.ranks * 4
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(n, 32)), batch_size=4))
    if trainer.is_global_zero:
        with open(os.path.join(args.root, "result.json"), "w") as f:
            json.dump({"starts": timer.starts}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.getcwd())
    from lightning_ft.events import read_events
    from tests.helpers import free_port, subprocess_env

    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        cmd += [__file__, "--worker", "--root", root, "--ranks", str(args.ranks)]
        cmd += ["--steps", str(args.steps), "--every", str(args.every)]
        env = subprocess_env(MASTER_PORT=str(free_port()))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"benchmark run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(os.path.join(root, "result.json")) as f:
            starts = json.load(f)["starts"]
        checks = [e for e in read_events(root) if e["event"].startswith("health_check") and e.get("periodic")]
    # Step i runs from starts[i] to starts[i + 1] and ends with global_step == i + 1.
    times = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    pairs = [
        (times[i], times[i - 1])
        for i in range(max(WARMUP, 1), len(times))
        if (i + 1) % args.every == 0 and i % args.every != 0
    ]
    plain = [t for i, t in enumerate(times) if i >= WARMUP and (i + 1) % args.every != 0]
    cost_s = statistics.median(with_ - without for with_, without in pairs)
    step_s = statistics.median(plain)
    inside_s = statistics.median(e["duration_s"] for e in checks)
    failed = sum(e["event"] == "health_check_failed" for e in checks)
    print(f"{args.ranks} gloo ranks, {STEP_MS:.0f} ms steps, a periodic check every {args.every} steps")
    print(f"  checks: {len(checks)} ({failed} failed); paired step pairs: {len(pairs)}")
    print(f"  plain step, median:                     {step_s * 1e3:8.2f} ms")
    print(f"  step with a check - the step before:    {cost_s * 1e3:8.2f} ms (median over pairs)")
    print(f"  the check itself on rank 0 (duration_s): {inside_s * 1e3:8.2f} ms (median)")
    print(f"  step with a check / step before:        {statistics.median(a / b for a, b in pairs):8.3f}x")
    overhead = cost_s / (DEFAULT_EVERY * step_s)
    print(f"  overhead at the default interval ({DEFAULT_EVERY} steps): {overhead * 100:.3f}% of step time")


if __name__ == "__main__":
    main()
