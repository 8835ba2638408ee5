"""Where one lightning-ft checkpoint's time goes, on every rank, while the ranks keep computing.

Starts 2 ranks (gloo, no Lightning), each holding the same ``--size-mb`` state (float32 tensors of 16 MB, a
data-parallel replica: each rank writes half). Each rank runs a matmul loop that stands in for training; every
``--every`` iterations it saves through ``AsyncCheckpointer``. The phases are timed by wrapping the checkpointer's own
functions:

- save call: ``AsyncCheckpointer.save`` (JSON, ownership, and the copy of every byte this rank writes, at the call);
- copy at the call: ``Stager.capture`` (part of the save call);
- checksum: the CRC32 of the staged bytes (:mod:`lightning_ft.checkpoint.checksum`); write: ``SnapshotStorage.write`` (torchsnapshot and the writes), of
  which fsync: every ``os.fsync``; collectives: the three ``agree`` exchanges; commit: metadata file and marker;
- loop slowdown: how much longer the iterations between a save and its commit took than the median iteration
  without a save in flight (what training loses to the writer on a machine short of cores).

Beside each phase's wall time, the CPU time of the thread that ran it; and the CPU time of each thread of the save, all
of it (the writer thread, torchsnapshot's I/O threads, which make the file writes), per
checkpoint: on a machine short of cores that CPU time is what training loses. ``--buffered`` writes through the page
cache instead of ``O_DIRECT``, ``--niceness`` sets the writer's priority, for comparison.

Run: ``python benchmarks/checkpoint_breakdown.py [--size-mb 350] [--saves 4] [--every 60] [--buffered]
[--niceness 19]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPU = " CPU"  # suffix of a phase's CPU time (the calling thread's), beside its wall time


def _timed(totals: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            totals[name + CPU] += time.thread_time() - cpu

    return wrapper


def _thread_cpu(totals: dict[str, float]) -> None:
    """Book every thread's CPU time when it ends, by what it does (they end at each save or at ``close()``)."""
    import threading

    run = threading.Thread.run

    def counted(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            kind = {"lightning-ft-checkpoint-writer": "writer thread", "lightning-ft-checkpoint-capture": "capture"}
            name = kind.get(self.name, "file writes (torchsnapshot I/O threads)" if "asyncio" in self.name else "")
            if name:
                totals["thread: " + name + CPU] += time.thread_time()

    threading.Thread.run = counted  # type: ignore[method-assign]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_ft.checkpoint import AsyncCheckpointer
    from lightning_ft.checkpoint import async_checkpointer as ac
    from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
    from lightning_ft.checkpoint.staging import Stager

    totals: dict[str, float] = defaultdict(float)
    _thread_cpu(totals)
    if args.buffered:  # the page cache instead of O_DIRECT, for comparison
        from lightning_ft.checkpoint import snapshot_storage

        write_file = snapshot_storage.write_file
        snapshot_storage.write_file = lambda path, parts, direct=True: write_file(path, parts, direct=False)
    ac.agree = _timed(totals, "collectives", ac.agree)
    ac.write_metadata = _timed(totals, "commit (metadata + marker)", ac.write_metadata)
    ac.write_marker = _timed(totals, "commit (metadata + marker)", ac.write_marker)
    ac.crc32 = _timed(totals, "checksum", ac.crc32)
    SnapshotStorage.write = _timed(totals, "write (torchsnapshot + fsync)", SnapshotStorage.write)
    os.fsync = _timed(totals, "  of which fsync", os.fsync)
    Stager.capture = _timed(totals, "copy at the call", Stager.capture)

    n = max(1, round(args.size_mb * 1e6 / (4 * 2048 * 2048)))
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(2048, 2048)) for _ in range(n))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    checkpointer = AsyncCheckpointer(writer_niceness=args.niceness)
    a = torch.randn(512, 512)
    iteration_s, in_flight = [], []
    save_call = []
    for i in range(args.every * (args.saves + 1)):
        start = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ a) / 16  # the forward and backward
        optimizer.step()
        busy = checkpointer.in_flight is not None
        if i % args.every == args.every - 1 and i // args.every < args.saves:
            t = time.perf_counter()
            checkpointer.save(Path(root) / f"step={i}", {"model": model.state_dict()}, metadata={"step": i})
            save_call.append(time.perf_counter() - t)
        iteration_s.append(time.perf_counter() - start)
        in_flight.append(busy)
    checkpointer.close()
    typical = statistics.median(d for d, busy in zip(iteration_s, in_flight, strict=True) if not busy)
    lost = sum(d - typical for d, busy in zip(iteration_s, in_flight, strict=True) if busy) / args.saves
    result = {name: total / args.saves for name, total in totals.items()}
    result["save call"] = statistics.median(save_call[1:] or save_call)
    result["loop slowdown while writing"] = lost
    result["typical iteration"] = typical
    out.put((rank, result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=350.0)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=60, help="iterations between saves (let each save finish)")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--buffered", action="store_true", help="write through the page cache instead of O_DIRECT")
    parser.add_argument("--niceness", type=int, default=19, help="AsyncCheckpointer(writer_niceness=...)")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        procs = [ctx.Process(target=_rank, args=(r, 2, port, args, root, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get()[:2] for _ in procs)
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a rank failed")
    print(
        f"\nstate {args.size_mb:.0f} MB per rank (each rank writes half), 2 ranks, per checkpoint (mean of"
        f" {args.saves}), {'buffered writes' if args.buffered else 'O_DIRECT writes'}, writer nice +{args.niceness};"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    order = ["save call", "copy at the call", "checksum", "write (torchsnapshot + fsync)",
             "  of which fsync", "collectives", "commit (metadata + marker)", "loop slowdown while writing",
             "typical iteration"]  # fmt: skip
    names = [n for n in order if any(n in r for r in results.values())]
    print("| phase | rank 0 wall ms | rank 0 CPU ms | rank 1 wall ms | rank 1 CPU ms |\n|---|---|---|---|---|")
    for name in names:
        cells = [f"{r.get(name, 0) * 1e3:.1f} | " + (f"{r[name + CPU] * 1e3:.1f}" if name + CPU in r else "-")
                 for r in (results[0], results[1])]  # fmt: skip
        print(f"| {name} | {' | '.join(cells)} |")
    threads = sorted({n for r in results.values() for n in r if n.startswith("thread: ")})
    for name in threads:
        label = name.removeprefix("thread: ").removesuffix(CPU)
        cells = [f"- | {r.get(name, 0) * 1e3:.1f}" for r in (results[0], results[1])]
        print(f"| {label}, all of it | {' | '.join(cells)} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
