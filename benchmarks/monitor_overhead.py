"""Overhead of StragglerMonitor, ThermalMonitor (fake NVML) and GoodputMonitor on a 4-rank CPU run with ~20 ms steps.

Runs the same Lightning DDP job (gloo, 4 processes, a tiny model whose step takes ~20 ms) with the monitors off and
on, alternating, and prints per configuration the mean step time over the measured steps (after warm-up) and the
overhead ratio ``on / off - 1``. It also prints the time spent inside the monitors' own hooks per step on rank 0,
which is the overhead without the machine's noise. Goal: under 1%.

Each monitor alone and all three are compared with none, repetitions interleaved; the end-to-end overhead is noisy
on a shared machine (it needs many repetitions to resolve 0.5%), the time inside the hooks is not.

Run: ``python benchmarks/monitor_overhead.py [--steps 400] [--repeats 2] [--configs none straggler thermal goodput all]``.
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
CONFIGS = ["none", "straggler", "thermal", "goodput", "all"]
WARMUP = 30


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft.monitors import FakeNVML, GoodputMonitor, StragglerMonitor, ThermalMonitor

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
        def __init__(self) -> None:
            self.t0 = 0.0
            self.t1 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == WARMUP:
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            self.t1 = time.perf_counter()

    every = {
        "straggler": StragglerMonitor,
        "thermal": lambda: ThermalMonitor(nvml=FakeNVML(device_count=4)),
        "goodput": GoodputMonitor,
    }
    names = list(every) if args.monitors == "all" else [n for n in every if n == args.monitors]
    monitors = [every[name]() for name in names]
    hook_s = [0.0]
    gather_s = [0.0]
    from lightning_ft.monitors import _collectives, straggler_monitor, thermal_monitor

    def timing(fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                gather_s[0] += time.perf_counter() - start

        return timed

    straggler_monitor.start_gather_rows = timing(straggler_monitor.start_gather_rows)
    thermal_monitor.start_gather_rows = timing(thermal_monitor.start_gather_rows)
    _collectives.PendingRows.wait = timing(_collectives.PendingRows.wait)
    for m in monitors:
        for name in dir(m):
            if name.startswith("on_") or name in ("setup",):
                fn = getattr(m, name)

                def timed(*a, _fn=fn, **k):
                    start = time.perf_counter()
                    try:
                        return _fn(*a, **k)
                    finally:
                        hook_s[0] += time.perf_counter() - start

                setattr(m, name, timed)
    timer = StepTimer()
    n = args.steps * 4 * 4
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy="ddp",
        max_steps=args.steps,
        default_root_dir=args.root,
        logger=CSVLogger(args.root, name="logs"),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *monitors],
    )
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(n, 32)), batch_size=4))
    if trainer.is_global_zero:
        measured = args.steps - WARMUP
        with open(os.path.join(args.root, "result.json"), "w") as f:
            json.dump(
                {
                    "step_ms": (timer.t1 - timer.t0) * 1000 / measured,
                    "hook_ms": hook_s[0] * 1000 / args.steps,
                    "gather_ms": gather_s[0] * 1000 / args.steps,
                },
                f,
            )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_once(monitors: str, steps: int) -> dict:
    sys.path.insert(0, os.getcwd())
    from tests.helpers import free_port, subprocess_env

    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, __file__, "--worker", "--root", root, "--steps", str(steps), "--monitors", monitors]
        env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"benchmark worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(os.path.join(root, "result.json")) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--monitors", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, help="monitor sets to compare")
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    configs = ["none", *[c for c in args.configs if c != "none"]]
    results: dict[str, list[dict]] = {c: [] for c in configs}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for _ in range(args.repeats):
        for config in configs:  # interleaved: the machine's load drifts alike for every configuration
            results[config].append(run_once(config, args.steps))
    off = statistics.median(r["step_ms"] for r in results["none"])
    print(
        f"4 ranks, gloo, {args.steps} steps (first {WARMUP} not measured), median of {args.repeats} interleaved runs;"
    )
    print(f"load average at start {load}")
    print("| monitors | step ms | end-to-end overhead | inside hooks ms/step | of a step | of which collectives ms |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        step = statistics.median(r["step_ms"] for r in results[config])
        hooks = statistics.median(r["hook_ms"] for r in results[config])
        gather = statistics.median(r["gather_ms"] for r in results[config])
        print(f"| {config} | {step:.2f} | {step / off - 1:+.2%} | {hooks:.3f} | {hooks / off:.2%} | {gather:.3f} |")
    print("goal: all three under 1% of step time end to end")


if __name__ == "__main__":
    main()
