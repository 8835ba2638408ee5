"""The memory tier against the durable tier: load time at resume, cost beside training, lost work per failure.

1. Load time (``--sizes-mb 100 1000``): one rank's state of that size saved by the durable tier
   (:class:`~lightning_ft.checkpoint.AsyncCheckpointer` into ``--durable-dir``) and by the memory tier (a memory copy in
   ``--memory-dir``, default ``/dev/shm``); then loaded back as a resume does: the durable tier with
   :func:`~lightning_ft.checkpoint.load_checkpoint` (checksums checked), the memory tier as a local resume does (the
   plan's checks of marker, metadata and layout, then the load, checksums checked). Repetitions interleaved; medians.
2. Cost beside training: a Trainer fit of a small GPT (``--steps`` steps) with ``MemoryTier(every_n_train_steps=10)``
   against the same fit without it; the time from step 10 to the last step, interleaved, medians; and the median
   ``stall_s`` of the memory saves (the time a save blocks the loop) against the median step time.
3. Lost work per failure: the steps recomputed after a failure at a uniformly random step, for a save every ``k``
   steps: ``(k - 1) / 2`` on average, ``k - 1`` at most (exact for the schedule; not a measurement).

The durable folder here is a local disk, measured twice: as the page cache serves it right after the save (a lower
bound: both tiers are then read from RAM), and with its pages dropped first (``posix_fadvise(DONTNEED)``: read from the
disk, as a durable tier on a shared filesystem or an object store is). Pass ``--durable-dir`` on the storage a job
uses.

Run: ``python benchmarks/memory_tier.py [--sizes-mb 100 1000] [--repeats 3] [--steps 60]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint  # noqa: E402
from lightning_ft.checkpoint.internal import (  # noqa: E402
    MemoryCopy,
    Stager,
    capture_own,
    check_copy,
    load_copy,
    write_copy,
)


def _state(size_mb: int) -> dict:
    n = size_mb * 2**20 // 4
    return {"state_dict": {f"w{i}": torch.randn(n // 8) for i in range(8)}, "global_step": 10}


def _drop_from_page_cache(folder: Path) -> None:
    """Evict the folder's (clean, fsync'd) pages, so the next read comes from the storage and not from this node's RAM,
    as it does for a durable tier on a shared filesystem or an object store."""
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_times(size_mb: int, repeats: int, durable_dir: Path, memory_dir: Path, *, cold: bool) -> tuple[float, float]:
    state = _state(size_mb)
    durable = durable_dir / f"bench-{size_mb}"
    memory = memory_dir / "lightning-ft" / "benchmark" / "rank0" / "step=10"
    checkpointer = AsyncCheckpointer()
    checkpointer.save(durable, state, metadata={"step": 10})
    checkpointer.close()
    write_copy(memory, capture_own(state, {}, Stager()), {"step": 10, "memory_rank": 0}, step=10)
    del state
    durable_s, memory_s = [], []
    try:
        for _ in range(repeats):
            if cold:
                _drop_from_page_cache(durable)
            start = time.perf_counter()
            load_checkpoint(durable)
            durable_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            # What a local resume does: the plan's checks of marker, metadata and layout, then the load, which checks
            # every shard's crc32 as it reads (the copy is read once).
            assert check_copy(MemoryCopy(0, 10, False, memory), {}, read_shards=False) is None
            load_copy(memory)
            memory_s.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(durable, ignore_errors=True)
        shutil.rmtree(memory_dir / "lightning-ft" / "benchmark", ignore_errors=True)
    return statistics.median(durable_s), statistics.median(memory_s)


def fit_time(root: Path, *, memory_every: int, steps: int) -> tuple[float, list[float]]:
    """Seconds from step 10 to step ``steps``, and the ``stall_s`` of each memory save."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from examples.gpt import GPT, SyntheticTokens
    from lightning_ft import ElasticFT3D, MemoryTier

    class Clock(Callback):
        start = end = 0.0

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 10:
                self.start = time.perf_counter()
            if trainer.global_step == steps:
                self.end = time.perf_counter()

    clock = Clock()
    L.seed_everything(0)
    tier = MemoryTier(every_n_train_steps=memory_every) if memory_every else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticFT3D(memory_tier=tier, fault=None),
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    model = GPT(vocab_size=256, dim=256, n_heads=4, n_layers=4, seq_len=64)
    data = DataLoader(SyntheticTokens(8 * steps, seq_len=64, vocab_size=256), batch_size=8)
    trainer.fit(model, train_dataloaders=data)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    from lightning_ft.events import read_events

    stalls = [
        e["stall_s"] for e in read_events(root) if e["event"] == "checkpoint_committed" and e.get("tier") == "memory"
    ]
    return clock.end - clock.start, stalls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--durable-dir", type=Path, default=None)
    p.add_argument("--memory-dir", type=Path, default=Path(os.environ.get("LIGHTNING_FT_MEMORY_DIR", "/dev/shm")))
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.durable_dir) as tmp:
        print("| state per rank | durable read from | durable load (s) | memory load (s) | ratio |")
        print("|---|---|---|---|---|")
        for size in args.sizes_mb:
            for cold in (False, True):
                durable, memory = load_times(size, args.repeats, Path(tmp), args.memory_dir, cold=cold)
                where = "storage (page cache dropped)" if cold else "page cache"
                print(f"| {size} MB | {where} | {durable:.3f} | {memory:.3f} | {durable / memory:.1f}x |", flush=True)
        if not args.skip_throughput:
            without, with_tier, stalls = [], [], []
            for n in range(args.repeats):
                without.append(fit_time(Path(tmp) / f"a{n}", memory_every=0, steps=args.steps)[0])
                elapsed, stall = fit_time(Path(tmp) / f"b{n}", memory_every=10, steps=args.steps)
                with_tier.append(elapsed)
                stalls += stall
            a, b = statistics.median(without), statistics.median(with_tier)
            step_s, stall_s = a / (args.steps - 10), statistics.median(stalls)
            print()
            print(
                f"| steps 10..{args.steps} | without (s) | memory every 10 (s) | cost | stall per save | stall / 10 steps |"
            )
            print("|---|---|---|---|---|---|")
            print(
                f"| small GPT (40 MB state), 1 rank | {a:.2f} | {b:.2f} | {100 * (b / a - 1):+.1f}% |"
                f" {1000 * stall_s:.0f} ms | {100 * stall_s / (10 * step_s):.1f}% |"
            )
    print()
    print("| save every k steps | lost steps per failure: mean | max |")
    print("|---|---|---|")
    for k in (10, 100, 1000):
        print(f"| {k} | {(k - 1) / 2:.1f} | {k - 1} |")


if __name__ == "__main__":
    main()
