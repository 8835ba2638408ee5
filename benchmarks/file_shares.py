"""The checkpoint file at two ranks against the folders and DDPStrategy's rank-0 ``torch.save``, in one run.

Two gloo ranks on CPU hold the same replicated state (``--state-mb`` of float32 tensors of 4 MiB on each rank, like a
model's weights and Adam state under data parallelism). Each method saves it ``--repeats`` times (after one warm-up
save that allocates the staging buffers, as the first checkpoint of a run does) and reports, per rank, the median of:

- loop stall: how long the save call blocks the caller (the training loop);
- write: from the save call until the checkpoint is committed (``AsyncCheckpointer.wait()`` returned on every rank;
  rank 0's ``CommitInfo.total_s`` for the async methods);
- MB written: bytes the process passed to write/pwrite from the save call to the commit (``wchar`` of
  /proc/self/io; includes the few kB of the process group's socket traffic);
- MB staged: bytes the save copied at the call (``Capture.nbytes``), and the resident memory the staging buffers keep
  (VmRSS after the warm-up save less before it).

Methods:

- ``file``: ``AsyncCheckpointer`` with ``FileStorage`` (what ``ElasticFT3D(checkpoint_format="file")`` runs): one
  ``torch.save`` file, every rank copying and writing about half of the tensor bytes;
- ``folders``: ``AsyncCheckpointer`` with ``SnapshotStorage`` (``checkpoint_format="torchsnapshot"``): a folder of
  shards, every rank copying and writing the tensors it owns;
- ``ddp``: Lightning's ``TorchCheckpointIO.save_checkpoint`` on rank 0 (what ``DDPStrategy`` runs: the whole state
  serialized in memory, then written), then an fsync so it is durable like the others; blocking, rank 1 idle.

Methods are interleaved, their order rotated from one repetition to the next (file, folders, ddp; folders, ddp, file;
...), each after an ``os.sync()`` (outside the timing) so that no method pays for the writeback of another's
buffered writes; every ratio compares numbers of the same run, and the load average is printed with them. For the file, the
phases of the parallel write (``SaveResult.phases_s``: plan, write, fsync, gather, finish) are printed per rank.

Run: ``python benchmarks/file_shares.py [--state-mb 100 1000] [--repeats 3] [--dir /tmp/x] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
METHODS = ("file", "folders", "ddp")


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _state(mb: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n = max(1, mb // 4)
    weights = {f"layer{i}.weight": torch.randn(1 << 20, generator=g) for i in range(n)}
    return {"state_dict": weights, "epoch": 1, "global_step": 10}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _worker(rank: int, port: int, state_mb: int, repeats: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=900))
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_ft.checkpoint import AsyncCheckpointer
    from lightning_ft.checkpoint.internal import SnapshotStorage
    from lightning_ft.checkpoint.single_file import FileStorage

    state = _state(state_mb)
    infos: dict[str, list[Any]] = {"file": [], "folders": []}
    rss0 = _rss()
    checkpointers = {
        "file": AsyncCheckpointer(storage=FileStorage(), on_commit=infos["file"].append),
        "folders": AsyncCheckpointer(storage=SnapshotStorage(), on_commit=infos["folders"].append),
    }
    ddp_io = TorchCheckpointIO()
    results: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    staging_rss: dict[str, int] = {}

    def one(method: str, path: Path) -> dict[str, float]:
        os.sync()  # the previous method's dirty pages (DDP's buffered file) are not flushed during this one
        dist.barrier()
        before = _wchar()
        start = time.perf_counter()
        staged = 0
        if method == "ddp":
            if rank == 0:
                ddp_io.save_checkpoint(state, path)
                _fsync(path)
            stall = time.perf_counter() - start
            dist.barrier()  # the other rank waits for rank 0, as Lightning's save_checkpoint does
        else:
            checkpointer = checkpointers[method]
            checkpointer.save(path, state, metadata={"step": 1})
            stall = time.perf_counter() - start
            staged = checkpointer._previous[1].nbytes  # the capture this rank copied at the call
            checkpointer.wait()
        write = time.perf_counter() - start
        written = _wchar() - before
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return {"stall_s": stall, "write_s": write, "written": written, "staged": staged}

    for method in ("file", "folders"):  # warm-up: the staging buffers are allocated once per run
        rss = _rss()
        one(method, Path(root) / f"warmup-{method}.ckpt")
        staging_rss[method] = _rss() - rss
    phases: list[dict[str, float]] = []
    for r in range(repeats):
        for k in range(len(METHODS)):  # rotated each repetition: no method always follows the same one
            method = METHODS[(k + r) % len(METHODS)]
            results[method].append(one(method, Path(root) / f"{method}-{r}.ckpt"))
            if method == "file":
                phases.append(checkpointers["file"]._storage.last_result.phases_s)
    for method in ("file", "folders"):
        checkpointers[method].close()
    committed = {m: [i.total_s for i in infos[m][1:]] for m in infos}  # rank 0; the warm-up save left out
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"results": results, "staging_rss": staging_rss, "rss0": rss0, "committed": committed, "phases": phases}, f
        )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(state_mb: int, repeats: int, directory: str | None) -> dict[str, Any]:
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=directory) as root, tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(_free_port(), state_mb, repeats, root, out),
            nprocs=WORLD_SIZE,
            start_method="spawn",
            join=True,
        )
        reports = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    load_after = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        per_rank = [report["results"][method] for report in reports]
        rows[method] = {
            "stall_ms": [statistics.median(x["stall_s"] for x in runs) * 1e3 for runs in per_rank],
            # the slowest rank of each repetition (every rank's wait() returns at the commit)
            "write_ms": statistics.median(max(per_rank[r][i]["write_s"] for r in range(WORLD_SIZE)) for i in
                                          range(repeats)) * 1e3,
            "written_mb": [statistics.median(x["written"] for x in runs) / 1e6 for runs in per_rank],
            "staged_mb": [statistics.median(x["staged"] for x in runs) / 1e6 for runs in per_rank],
            "staging_rss_mb": [report["staging_rss"].get(method, 0) / 1e6 for report in reports],
        }  # fmt: skip
        committed = reports[0]["committed"].get(method)
        if committed:
            rows[method]["commit_ms"] = statistics.median(committed) * 1e3
    print(
        f"\n{state_mb} MB of replicated state on each of {WORLD_SIZE} ranks, median of {repeats} (interleaved);"
        f" load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {load_after[0]:.2f} after"
    )
    print(
        "| method | loop stall ms (rank 0 / 1) | write ms (save call to commit) | MB written (rank 0 / 1) |"
        " MB staged (rank 0 / 1) | staging RSS MB (rank 0 / 1) |"
    )
    print("|" + "---|" * 6)
    for method, row in rows.items():
        pair = lambda v: " / ".join(f"{x:.0f}" for x in v)  # noqa: E731
        stall = " / ".join(f"{x:.1f}" for x in row["stall_ms"])
        print(
            f"| {method} | {stall} | {row['write_ms']:.0f} | {pair(row['written_mb'])} | {pair(row['staged_mb'])}"
            f" | {pair(row['staging_rss_mb'])} |"
        )
    for rank, report in enumerate(reports):
        medians = {k: statistics.median(p[k] for p in report["phases"]) * 1e3 for k in report["phases"][0]}
        print(
            f"  file, rank {rank}, the parallel write's phases (ms): "
            + ", ".join(f"{k} {v:.0f}" for k, v in medians.items())
        )
    file, folders = rows["file"], rows["folders"]
    print(
        f"file / folders: write {file['write_ms'] / folders['write_ms']:.2f} (goal <= 1.10),"
        f" loop stall {max(file['stall_ms']) / max(folders['stall_ms']):.2f},"
        f" MB written per rank {max(file['written_mb']) / max(folders['written_mb']):.2f}"
    )
    return {"state_mb": state_mb, "load_before": load, "load_after": load_after, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args()
    results = [run(mb, args.repeats, args.dir) for mb in args.state_mb]
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
