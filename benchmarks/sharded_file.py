"""Tensor-parallel state (``Shard(0)``) saved as one checkpoint file of full tensors against the torchsnapshot folder.

Two CPU ranks (gloo), four ``Shard(0)`` DTensors of ``--mb-per-rank`` MB per rank in all, one small replicated one; each
format saves ``--repeats`` times through :class:`~lightning_ft.checkpoint.AsyncCheckpointer` (the strategy's writer):
the time from the save call until the commit, and the bytes each rank passed to ``write`` (``/proc/self/io``'s
``wchar``: the whole process, so the staging copies are not counted, the writer's files are).

    python benchmarks/sharded_file.py --mb-per-rank 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import run_distributed  # noqa: E402


def _written() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar"):
            return int(line.split()[1])
    return 0


def _bench(rank: int, world_size: int, mb_per_rank: int, repeats: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_ft.checkpoint import AsyncCheckpointer
    from lightning_ft.checkpoint.single_file import FileStorage
    from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tensor_parallel",))
    rows = mb_per_rank * world_size * (1 << 20) // 4 // 1024 // 4
    state = {
        "state_dict": {f"w{i}": distribute_tensor(torch.randn(rows, 1024), mesh, [Shard(0)]) for i in range(4)},
        "norm": distribute_tensor(torch.randn(1024), mesh, [Replicate()]),
    }
    results = {}
    for name, storage in (("file", FileStorage), ("folder", SnapshotStorage)):
        checkpointer = AsyncCheckpointer(storage=storage())
        times, written = [], []
        for k in range(repeats):
            dist.barrier()
            before, start = _written(), time.perf_counter()
            checkpointer.save(Path(root) / f"{name}-{k}.ckpt", state, metadata={"step": k})
            checkpointer.wait()
            times.append(time.perf_counter() - start)
            written.append(_written() - before)
        checkpointer.close()
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (statistics.median(times), statistics.median(written)))
        results[name] = gathered
    if rank == 0:
        for name, per_rank in results.items():
            ms = ", ".join(f"{t * 1000:.0f}" for t, _ in per_rank)
            mb = ", ".join(f"{w / 1e6:.1f}" for _, w in per_rank)
            print(f"{name:6s} save call to commit (median, per rank): {ms} ms; bytes written per rank: {mb} MB")
        ratio = results["file"][0][0] / results["folder"][0][0]
        print(f"file / folder time: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb-per-rank", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_bench, 2, args.mb_per_rank, args.repeats, root, timeout_s=1800)


if __name__ == "__main__":
    main()
