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
# Hooks that run at every training batch; the others (setup, on_train_start/end, ...) run once per run or per epoch.
PER_STEP_HOOKS = frozenset(
    {"on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
     "on_before_optimizer_step", "on_before_zero_grad"}
)  # fmt: skip


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

    steps: list[tuple[float, bool]] = []  # (seconds, monitors on) of each measured step
    gate = [True]

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[tuple[float, bool]] = []
            self.t0 = 0.0
            self.t1 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            if trainer.global_step == WARMUP:
                self.t0 = now
                measuring[0] = True
            if measuring[0] and self.starts:
                steps.append((now - self.starts[-1][0], self.starts[-1][1]))
            if args.block:  # paired: the monitors' per-step hooks run in every other block of steps only
                gate[0] = (trainer.global_step // args.block) % 2 == 1
            self.starts.append((now, gate[0]))

        def on_train_end(self, trainer, pl_module):
            self.t1 = time.perf_counter()
            measuring[0] = False

    every = {
        "straggler": StragglerMonitor,
        "thermal": lambda: ThermalMonitor(nvml=FakeNVML(device_count=4)),
        "goodput": GoodputMonitor,
    }
    names = list(every) if args.monitors == "all" else [n for n in every if n == args.monitors]
    monitors = [every[name]() for name in names]
    hook_s = [0.0]  # inside the per-step hooks, over the measured steps
    once_s = [0.0]  # set-up, start and end of training: once per run, not per step
    gather_s = [0.0]
    measuring = [False]
    from lightning_ft.monitors import _collectives, straggler_monitor, thermal_monitor

    def timing(fn):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if measuring[0]:
                    gather_s[0] += time.perf_counter() - start

        return timed

    straggler_monitor.start_gather_rows = timing(straggler_monitor.start_gather_rows)
    thermal_monitor.start_gather_rows = timing(thermal_monitor.start_gather_rows)
    _collectives.PendingRows.wait = timing(_collectives.PendingRows.wait)
    for m in monitors:
        for name in dir(m):
            if name.startswith("on_") or name in ("setup",):
                fn = getattr(m, name)

                def timed(*a, _fn=fn, _per_step=name in PER_STEP_HOOKS, **k):
                    if _per_step and not gate[0]:
                        return None
                    start = time.perf_counter()
                    try:
                        return _fn(*a, **k)
                    finally:
                        if not _per_step:
                            once_s[0] += time.perf_counter() - start
                        elif measuring[0]:
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
                    "hook_ms": hook_s[0] * 1000 / measured,
                    "gather_ms": gather_s[0] * 1000 / measured,
                    "once_ms": once_s[0] * 1000,
                    "steps": steps,
                },
                f,
            )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_once(monitors: str, steps: int, block: int = 0) -> dict:
    sys.path.insert(0, os.getcwd())
    from tests.helpers import free_port, subprocess_env

    with tempfile.TemporaryDirectory() as root:
        cmd = [sys.executable, __file__, "--worker", "--root", root, "--steps", str(steps), "--monitors", monitors]
        cmd += ["--block", str(block)]
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
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="B",
        help="instead: one run per repetition and configuration with the monitors' per-step hooks on in every other"
        " block of B steps; compares each on-block with the off-block before it in the same processes",
    )
    parser.add_argument("--block", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.paired:
        paired(args)
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
    print(
        "| monitors | step ms | end-to-end overhead | inside per-step hooks ms/step | of a step"
        " | of which collectives ms | once per run (set-up, start, end) ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for config in configs:
        step = statistics.median(r["step_ms"] for r in results[config])
        hooks = statistics.median(r["hook_ms"] for r in results[config])
        gather = statistics.median(r["gather_ms"] for r in results[config])
        once = statistics.median(r["once_ms"] for r in results[config])
        print(
            f"| {config} | {step:.2f} | {step / off - 1:+.2%} | {hooks:.3f} | {hooks / off:.2%} | {gather:.3f}"
            f" | {once:.0f} |"
        )
    print("goal: all three under 1% of step time end to end")


def block_pairs(steps: list[tuple[float, bool]]) -> list[float]:
    """``on / off - 1`` of each on-block against the off-block just before it (each block's first step left out: it
    may carry the previous block's background work)."""
    blocks: list[tuple[bool, list[float]]] = []
    for seconds, on in steps:
        if not blocks or blocks[-1][0] != on:
            blocks.append((on, []))  # the first step of a block is not kept
            continue
        blocks[-1][1].append(seconds)
    ratios = []
    for (was_on, before), (on, after) in zip(blocks, blocks[1:], strict=False):
        if on and not was_on and before and after:
            ratios.append(statistics.mean(after) / statistics.mean(before) - 1)
    return ratios


def paired(args: argparse.Namespace) -> None:
    configs = [c for c in args.configs if c != "none"]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ratios: dict[str, list[float]] = {c: [] for c in configs}
    hooks: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for config in configs:
            result = run_once(config, args.steps, block=args.paired)
            ratios[config] += block_pairs([(s, bool(on)) for s, on in result["steps"]])
            hooks[config].append(result["hook_ms"] * 2)  # the hooks ran in half of the measured steps
    print(
        f"4 ranks, gloo, {args.steps} steps (first {WARMUP} not measured), monitors on in every other block of"
        f" {args.paired} steps, {args.repeats} run(s) per configuration; load average at start {load}"
    )
    print("| monitors | block pairs | overhead, mean | standard error | median | inside per-step hooks ms/step |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        r = ratios[config]
        error = statistics.stdev(r) / len(r) ** 0.5 if len(r) > 1 else float("nan")
        print(
            f"| {config} | {len(r)} | {statistics.mean(r):+.2%} | {error:.2%} | {statistics.median(r):+.2%}"
            f" | {statistics.median(hooks[config]):.3f} |"
        )
    print("goal: all three under 1% of step time end to end")


if __name__ == "__main__":
    main()
