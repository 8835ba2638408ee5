"""What it costs every step for the ranks to agree on a preemption signal (2 gloo ranks by default).

Each rank runs a loop of fake steps (a sleep standing in for device compute, ``--step-ms``) and, at every step
boundary, one of:

- ``sync all_reduce``: a blocking all-reduce (MIN) of one float64, the simplest agreement;
- ``sync all_gather``: a blocking all-gather of two float64 per rank (signal time and number);
- ``pipelined, every step``: :class:`lightning_ft.fault.agreement.StopAgreement` checking at every boundary, the
  all-gather started at one boundary and read at the next;
- ``ours``: ``StopAgreement`` as ``ElasticFT3D`` uses it: checks about a second of training apart, at most every 10
  steps (every step here would be 2 ms apart, so every tenth);
- ``sync every 10``: the blocking all-gather at every tenth boundary only.

It prints, per variant, the time spent inside the agreement call per step on rank 0 (median and mean, microseconds),
which is the cost a step pays without the machine's noise, and the wall time per step against the loop with no
agreement. Rank 1 is made slower by ``--skew-ms`` per step, every other step, as a real straggling rank would be.

Run: ``python benchmarks/preemption_agreement.py [--steps 2000] [--step-ms 2] [--world-size 2] [--skew-ms 0.5]``.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("none", "sync all_reduce", "sync all_gather", "pipelined, every step", "ours", "sync every 10")


def _loop(variant: str, args: argparse.Namespace, rank: int, world_size: int) -> tuple[float, list[float]]:
    from lightning_ft.fault.agreement import StopAgreement
    from lightning_ft.fault.signals import PreemptionSignals

    agreement = None
    if variant in ("pipelined, every step", "ours"):
        max_interval = 1 if variant == "pipelined, every step" else 10
        agreement = StopAgreement(PreemptionSignals((signal.SIGUSR1,)), max_interval=max_interval)
    gather = [torch.empty(2, dtype=torch.float64) for _ in range(world_size)]
    row = torch.tensor([math.nan, 0.0], dtype=torch.float64)
    inside: list[float] = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        time.sleep((args.step_ms + (args.skew_ms if rank == 1 and step % 2 else 0.0)) / 1000.0)
        t0 = time.perf_counter()
        if variant == "sync all_reduce":
            flag = torch.tensor([math.inf], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        elif variant == "sync all_gather" or (variant == "sync every 10" and step % 10 == 0):
            dist.all_gather(gather, row)
        elif agreement is not None:
            agreement.poll()
        inside.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    if agreement is not None:
        agreement.close()
    dist.barrier()
    return wall / args.steps, inside


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for _ in range(args.repeats):
            for variant in VARIANTS:
                per_step, inside = _loop(variant, args, rank, world_size)
                results.setdefault(variant, []).append((per_step, inside))
        if rank == 0:
            queue.put(results)  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--skew-ms", type=float, default=0.5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
    base = statistics.median(per_step for per_step, _ in results["none"])
    print(f"{args.world_size} gloo ranks, {args.steps} steps of {args.step_ms} ms (+{args.skew_ms} ms skew on rank 1)")
    print(f"{'variant':<18} {'inside, median':>15} {'inside, mean':>13} {'wall/step':>10} {'vs none':>8}")
    for variant in VARIANTS:
        inside = [t for _, ts in results[variant] for t in ts]
        per_step = statistics.median(p for p, _ in results[variant])
        print(
            f"{variant:<18} {statistics.median(inside) * 1e6:>12.1f} us {statistics.fmean(inside) * 1e6:>10.1f} us"
            f" {per_step * 1e3:>7.3f} ms {per_step / base - 1:>+7.1%}"
        )


if __name__ == "__main__":
    main()
