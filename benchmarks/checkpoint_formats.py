"""torchsnapshot against DCP behind the same seam: time to a durable commit and time to load, in one CPU process.

For each state size (float32 tensors of 4 MiB), ``AsyncCheckpointer`` saves four times with each storage and
``load_checkpoint`` reads three of them back; the first save (which allocates the staging buffers) is left out.
Run: ``python benchmarks/checkpoint_formats.py [--sizes-mb 50 200] [--dir /tmp/x]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint
from lightning_ft.checkpoint.internal import CommitInfo, SnapshotStorage
from lightning_ft.checkpoint.storage import DcpStorage


def measure(storage: object, state: dict[str, torch.Tensor], root: Path) -> tuple[float, float]:
    infos: list[CommitInfo] = []
    writer = AsyncCheckpointer(storage=storage, on_commit=infos.append)
    for r in range(4):
        writer.save(root / f"c{r}", state, metadata={"step": r})
        writer.wait()
    writer.close()
    loads = []
    for r in range(1, 4):
        start = time.perf_counter()
        load_checkpoint(root / f"c{r}", storage=storage)
        loads.append(time.perf_counter() - start)
    return statistics.median(i.total_s for i in infos[1:]), statistics.median(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"{'state':>7} {'format':>14} {'save (ms)':>10} {'load (ms)':>10}")
    for size in args.sizes_mb:
        state = {f"layer{i}.weight": torch.randn(1 << 20) for i in range(max(1, size // 4))}
        for name, storage in (("torchsnapshot", SnapshotStorage()), ("dcp", DcpStorage())):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                save_s, load_s = measure(storage, state, Path(tmp))
            print(f"{size:>5}MB {name:>14} {save_s * 1000:>10.0f} {load_s * 1000:>10.0f}")


if __name__ == "__main__":
    main()
