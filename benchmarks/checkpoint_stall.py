"""How long a lightning-ft checkpoint blocks training, against the whole write and a synchronous ``torch.save``.

For a ~50 MB and a ~200 MB state (float32 tensors of 4 MB, like a model's parameters), in one CPU process:

- stall: time until ``AsyncCheckpointer.save()`` returns (the copy of every tensor into staging buffers, at the call);
- copy floor: one ``copy_`` of the same tensors into buffers allocated beforehand, nothing else: what any consistent
  capture must pay at the call, and what the stall is measured against;
- total: time until the commit marker is durable (``CommitInfo.total_s``);
- torch.save: a synchronous ``torch.save`` of the same state plus an fsync, which blocks training for all of it.

The first save allocates the staging buffers; later saves reuse them, which is the steady state of a training run.
Run: ``python benchmarks/checkpoint_stall.py [--sizes-mb 50 200] [--repeats 3] [--dir /tmp/x]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_ft.checkpoint import AsyncCheckpointer
from lightning_ft.checkpoint.internal import CommitInfo


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    per_tensor = 1 << 20  # float32 elements: 4 MiB per tensor
    count = max(1, size_mb * (1 << 20) // (4 * per_tensor))
    return {f"layer{i}.weight": torch.randn(per_tensor) for i in range(count)}


def torch_save_s(state: dict[str, torch.Tensor], path: Path) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def copy_floor_s(state: dict[str, torch.Tensor], repeats: int) -> float:
    buffers = [torch.empty_like(t) for t in state.values()]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for buf, tensor in zip(buffers, state.values(), strict=True):
            buf.copy_(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(size_mb: int, repeats: int, root: Path) -> None:
    state = make_state(size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    commits: list[CommitInfo] = []
    checkpointer = AsyncCheckpointer(on_commit=commits.append)
    stalls = []
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            checkpointer.save(root / f"{size_mb}mb-step={i}", {"model": state}, metadata={"step": i})
            stalls.append(time.perf_counter() - start)
            checkpointer.wait()
            for tensor in state.values():
                tensor.add_(1.0)  # the training step
    finally:
        checkpointer.close()
    sync = [torch_save_s(state, root / f"{size_mb}mb-{i}.pt") for i in range(repeats)]
    first_stall, steady_stall = stalls[0], statistics.median(stalls[1:])
    total = statistics.median(c.total_s for c in commits[1:])
    sync_s = statistics.median(sync)
    floor = copy_floor_s(state, repeats)
    print(f"state {nbytes / 1e6:.0f} MB ({len(state)} tensors), median of {repeats}:")
    print(f"  stall (save() returns)     first {first_stall * 1e3:8.1f} ms   steady {steady_stall * 1e3:8.1f} ms")
    print(
        f"  copy floor (copy_ alone)         {floor * 1e3:8.1f} ms   ({floor * 1e3 * 100e6 / nbytes:.1f} ms per 100 MB)"
    )
    print(f"  total (marker durable)           {total * 1e3:8.1f} ms")
    print(f"  torch.save + fsync               {sync_s * 1e3:8.1f} ms")
    print(
        f"  ratios: stall/copy floor {steady_stall / floor:.2f}   stall/total {steady_stall / total:.3f}   "
        f"stall/torch.save {steady_stall / sync_s:.3f}   "
        f"total/torch.save {total / sync_s:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size_mb in args.sizes_mb:
            measure(size_mb, args.repeats, Path(tmp))


if __name__ == "__main__":
    main()
