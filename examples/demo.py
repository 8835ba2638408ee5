"""lightning-ft demo: a small GPT on synthetic tokens, 2 CPU ranks under torchrun: a killed rank, a preemption, a hang.

Run it with the README's first command (``bash scripts/demo.sh``), or directly::

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/demo.py --root demo_run

What happens: checkpoints are written asynchronously every few steps; at ``--kill-at-step`` rank 1 kills itself with
SIGKILL on the first attempt; torchrun tears the group down and starts it again; ``trainer.fit`` finds the newest
committed checkpoint by itself and training continues. On the second attempt rank 0 receives SIGTERM (a preemption):
every rank commits ``preempt-step=<N>`` and exits with code 75, and the next attempt resumes from it. On the third,
rank 1 hangs in a data read: the hang watchdog names it, dumps the stacks and exits, and torchrun restarts the group.
TensorBoard logs go to ``<root>/tb``, event logs to
``<root>/lightning-ft/events``; rank 0 prints a short summary at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.gpt import GPT, SyntheticTokens  # noqa: E402
from lightning_ft import ElasticFT3D, FaultPolicy  # noqa: E402
from lightning_ft.events import get_event_log  # noqa: E402
from lightning_ft.fault import FaultInjector  # noqa: E402


class KillRankOnce(Callback):
    """Injects the fault: on the first attempt only, ``rank`` sends itself SIGKILL after step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            print(f"[demo] rank {self.rank}: killing myself with SIGKILL at step {self.step}", flush=True)
            get_event_log(trainer).write("fault_injected", kind="kill_at")  # the fault's time, for the report
            os.kill(os.getpid(), signal.SIGKILL)


def fault_injector(args: argparse.Namespace) -> FaultInjector:
    """The second and third incidents: a preemption signal on attempt 1, a rank stuck in a data read on attempt 2."""
    return (
        FaultInjector()
        .signal_at(rank=0, step=args.preempt_at_step, sig="SIGTERM", attempt=1)
        .hang_at(rank=1, step=args.hang_at_step, where="data", attempt=2)
    )


def announce(args: argparse.Namespace) -> None:
    """Rank 0 says, before each attempt trains, which incidents are simulated and what to expect on screen."""
    if os.environ.get("RANK", "0") != "0":
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        print(
            "[demo] Every incident below is simulated on this CPU machine; nothing is wrong with it:\n"
            f"[demo]   attempt 0: rank 1 kills itself with SIGKILL at step {args.kill_at_step}. The surviving rank\n"
            "[demo]              then prints gloo connection errors and a torchrun failure report: expected.\n"
            f"[demo]   attempt 1: SIGTERM at rank 0 at step {args.preempt_at_step} (a preemption notice).\n"
            f"[demo]   attempt 2: rank 1 hangs in a data read at step {args.hang_at_step}; the watchdog fires after"
            f" {args.hang_timeout:g} s.\n"
            f"[demo]   from step {args.incident_step} (after a restart), a fake NVML reports rank 1's device thermally"
            " throttled, and rank 1's steps are slowed down to match.\n"
            "[demo] torchrun restarts the group after each of the first three; every attempt resumes by itself.",
            flush=True,
        )
    else:
        print(
            f"[demo] attempt {attempt}: torchrun restarted the group; fit resumes from the newest checkpoint",
            flush=True,
        )


def build_callbacks(args: argparse.Namespace, ckpt_dir: Path, injector: FaultInjector) -> list[Callback]:
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1, save_last=True),
        KillRankOnce(rank=1, step=args.kill_at_step),
        injector,
    ]
    from examples.demo_monitors import monitor_callbacks

    callbacks.extend(monitor_callbacks(args))
    return callbacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="demo_run")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--incident-step", type=int, default=76, help="thermal incident on rank 1 after a restart")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--kill-at-step", type=int, default=17)
    parser.add_argument("--preempt-at-step", type=int, default=18, help="SIGTERM at rank 0 on the second attempt")
    parser.add_argument("--hang-at-step", type=int, default=42, help="rank 1 hangs in a data read on the third")
    parser.add_argument("--hang-timeout", type=float, default=8.0, help="FaultPolicy(hang_timeout_s=...)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    torch.set_num_threads(1)
    announce(args)
    L.seed_everything(7, workers=True)
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ckpt_dir = root / "checkpoints"
    started = time.time()
    injector = fault_injector(args)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")),
        strategy=ElasticFT3D(fault=FaultPolicy(hang_timeout_s=args.hang_timeout, first_step_timeout_s=120.0)),
        max_steps=args.max_steps,
        default_root_dir=root,
        logger=TensorBoardLogger(root, name="tb"),
        callbacks=build_callbacks(args, ckpt_dir, injector),
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPT(vocab_size=128, dim=64, n_heads=4, n_layers=2, seq_len=32)
    data = DataLoader(
        injector.wrap_dataset(SyntheticTokens(num_samples=512, seq_len=32, vocab_size=128)),
        batch_size=args.batch_size,
        shuffle=True,
    )
    trainer.fit(model, train_dataloaders=data)

    if trainer.global_rank == 0:
        from lightning_ft.events import read_events

        events = read_events(root)
        restarts = sorted({e["attempt"] for e in events if e["event"] == "attempt_start"})
        resumed = [e for e in events if e["event"] == "resumed"]
        stragglers = [e for e in events if e["event"] == "straggler"]
        thermal = [e for e in events if e["event"] == "thermal" and e.get("throttled", True)]
        commits = [e for e in events if e["event"] == "checkpoint_committed"]
        preempted = [e for e in events if e["event"] == "preempted" and e["rank"] == 0]
        hangs = [e for e in events if e["event"] == "hang"]
        print("\n[demo] summary")
        print(f"  attempts            : {len(restarts)} (torchrun restarted the group {len(restarts) - 1} time(s))")
        for e in resumed:
            print(f"  resumed from        : {e['path']} (step {e['step']}, saved on {e['saved_world_size']} ranks)")
        if commits:
            stall = sorted(e["stall_s"] for e in commits)[len(commits) // 2]
            total = sorted(e["total_s"] for e in commits)[len(commits) // 2]
            print(
                f"  checkpoints         : {len(commits)} committed, median stall {stall * 1e3:.1f} ms,"
                f" median total {total * 1e3:.1f} ms, {commits[-1]['size_bytes'] / 1e6:.2f} MB each"
            )
        for e in preempted[:1]:
            print(
                f"  preemption          : {e['signal']} at rank(s) {e['signal_ranks']}, every rank committed"
                f" {Path(e['checkpoint_path']).name} {e['time'] - e['signal_time']:.1f} s after the signal,"
                f" exit code {e['exit_code']}"
            )
        for e in hangs[:1]:
            print(
                f"  hang                : rank(s) {e['ranks']} stopped after step {e['heartbeats'][str(e['first_rank'])]['step']},"
                f" named by rank {e['rank']}'s watchdog after {e['idle_s']:.0f} s; stacks in {e['stacks_path']}"
            )
        for e in thermal[:1]:
            print(
                f"  thermal incident    : rank {e['rank']} device {e['device']} {', '.join(e['reasons'])}"
                f" at step {e['step']} ({e['temperature_c']:.0f} C, SM clock {e['sm_clock_mhz']:.0f} MHz)"
            )
        for e in stragglers[:1]:
            print(
                f"  straggler           : rank {e['suspect_rank']} named at step {e['step']},"
                f" {e['ratio']:.2f}x the fleet median (onset step {e.get('onset_step')})"
            )
        print(f"  final step / loss   : {trainer.global_step} / {float(trainer.callback_metrics['train_loss']):.3f}")
        print(f"  this attempt took   : {time.time() - started:.1f} s")
        print(f"  TensorBoard         : tensorboard --logdir {root / 'tb'}")


if __name__ == "__main__":
    main()
