"""One torch.save file written by every rank (``parallel_file.save``) against rank 0's ``torch.save`` and the folder.

Two gloo ranks on CPU hold the same replicated state (float32 tensors of 4 MiB, ``--mb-per-rank`` x ranks in all).
Each method writes it durably (fsync) three times; per method the median wall time (the slowest rank, from a barrier
to every rank done) and the bytes each rank passed to write/pwrite (``wchar`` of /proc/self/io):

- ``parallel_file``: every rank writes ~1/N of the tensor bytes into the one file, rank 0 the pickle and directory;
- ``torch.save``: rank 0 writes the whole file (what ``DDPStrategy`` does), then fsyncs it;
- ``folder``: lightning-ft's torchsnapshot folder (``SnapshotStorage``), each rank writing its 1/N of the same bytes;
- ``folder+crc32``: the same plus the CRC32 of those bytes, which lightning-ft's writer computes for a folder too (the
  file's write includes its CRCs).

Run: ``python benchmarks/parallel_file.py [--mb-per-rank 100 1000] [--dir /tmp/x]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ft.checkpoint import parallel_file
from lightning_ft.checkpoint.checksum import crc32
from lightning_ft.checkpoint.internal import SnapshotStorage

WORLD_SIZE = 2
REPEATS = 3


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _state(mb_total: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = max(1, mb_total // 4)
    return {"state_dict": {f"layer{i}.weight": torch.randn(1 << 20, generator=g) for i in range(n)}, "epoch": 1}


def _share(state: dict, rank: int) -> dict[str, torch.Tensor]:
    # This rank's 1/N of the same bytes, as the folder's flat uint8 entries.
    flat = [t.view(-1).view(torch.uint8) for t in state["state_dict"].values()]
    names = list(state["state_dict"])
    per = len(flat) // WORLD_SIZE
    lo, hi = rank * per, (rank + 1) * per if rank < WORLD_SIZE - 1 else len(flat)
    return {names[i]: flat[i] for i in range(lo, hi)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _worker(rank: int, port: int, mb_per_rank: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=600))
    state = _state(mb_per_rank * WORLD_SIZE)
    share = _share(state, rank)
    storage = SnapshotStorage()

    phases: list[dict[str, float]] = []

    def parallel(path: Path) -> None:
        phases.append(parallel_file.save(state, path / "model.ckpt").phases_s)

    def rank0_save(path: Path) -> None:
        if rank == 0:
            torch.save(state, path / "model.ckpt")
            _fsync(path / "model.ckpt")

    def folder(path: Path) -> None:
        storage.write(path / "model.ckpt", share, group=None)

    def folder_crc(path: Path) -> None:
        # What lightning-ft's writer does besides: a CRC32 of every tensor (the file's CRCs are part of its write).
        for tensor in share.values():
            crc32(memoryview(tensor.numpy()))
        storage.write(path / "model.ckpt", share, group=None)

    results: dict[str, list[tuple[float, int]]] = {}
    for name, fn in (
        ("parallel_file", parallel),
        ("torch.save", rank0_save),
        ("folder", folder),
        ("folder+crc32", folder_crc),
    ):
        for r in range(REPEATS):
            path = Path(root) / f"{name}-{r}"
            if rank == 0:
                path.mkdir()
            dist.barrier()
            before = _wchar()
            start = time.perf_counter()
            fn(path)
            dist.barrier()
            results.setdefault(name, []).append((time.perf_counter() - start, _wchar() - before))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"results": results, "phases": phases}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mb_per_rank: int, directory: str | None) -> None:
    with tempfile.TemporaryDirectory(dir=directory) as root, tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker, args=(_free_port(), mb_per_rank, root, out), nprocs=WORLD_SIZE, start_method="spawn", join=True
        )
        reports = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    ranks = [report["results"] for report in reports]
    rows = {}
    for name in ranks[0]:
        wall = statistics.median(max(ranks[r][name][i][0] for r in range(WORLD_SIZE)) for i in range(REPEATS))
        written = [statistics.median(x[1] for x in ranks[r][name]) / 1e6 for r in range(WORLD_SIZE)]
        rows[name] = (wall, written)
    base = rows["parallel_file"][0]
    print(
        f"\n{mb_per_rank} MB per rank, {WORLD_SIZE} ranks ({mb_per_rank * WORLD_SIZE} MB of tensors), median of {REPEATS}"
    )
    print(
        f"{'method':>14} {'write (ms)':>11} {'vs parallel':>12} "
        + " ".join(f"{'MB rank' + str(r):>9}" for r in range(WORLD_SIZE))
    )
    for name, (wall, written) in rows.items():
        cells = " ".join(f"{w:>9.1f}" for w in written)
        print(f"{name:>14} {wall * 1000:>11.0f} {wall / base:>11.2f}x {cells}")
    for rank, report in enumerate(reports):
        medians = {k: statistics.median(p[k] for p in report["phases"]) * 1000 for k in report["phases"][0]}
        print(f"  parallel_file rank {rank} phases (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb-per-rank", type=int, nargs="+", default=[100])
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    args = parser.parse_args()
    for mb in args.mb_per_rank:
        run(mb, args.dir)


if __name__ == "__main__":
    main()
