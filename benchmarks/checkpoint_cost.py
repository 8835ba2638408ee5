"""What a checkpoint every N steps costs a 2-rank CPU training run: lightning-ft against its peers and the floor.

Every contender trains the same model (a stack of ``Linear(2048, 2048)`` layers with Adam: weights plus Adam state is
``--size-mb``) with the same loop, under ``torchrun --nproc_per_node 2``, and checkpoints every ``--every`` steps:

- ``none`` / ``none-ft3d``: no checkpoint (Lightning's ``DDPStrategy`` / ``ElasticFT3D``): the baselines;
- ``ft3d``: ``ElasticFT3D`` with ``ModelCheckpoint`` (async, sharded, committed; every tensor copied at the save call),
  its default ``checkpoint_format="auto"``; ``ft3d-file`` / ``ft3d-folders``: the same with ``checkpoint_format="file"``
  (one ``torch.save`` file, each rank writing and copying its half) / ``"torchsnapshot"`` (a folder of shards);
- ``lightning-sync``: ``DDPStrategy`` with ``ModelCheckpoint`` (rank 0 ``torch.save``, blocking);
- ``lightning-async``: the same with Lightning's ``AsyncCheckpointIO`` (rank 0 clones, then writes from a thread);
- ``dcp-async``: ``torch.distributed.checkpoint.async_save`` on every rank, on a gloo group of its own, as Lightning
  users wire it (torch 2.13 without a stager: the state is copied on the caller);
- ``dcp-stager``: the same with torch's ``DefaultStager`` (shared-memory staging in a background thread; pinned memory
  and non-blocking copies need CUDA, so they are off here); the next ``optimizer_step`` waits for the staging to end,
  as the stager's contract requires, so the checkpoint is the state at its call;
- ``torch-ckpt``: meta-pytorch's ``torch-checkpointing`` 0.1.1 ``CheckpointManager`` with async save (staging in a
  thread, the write in a background process; pinned/non-blocking options off on CPU, as its troubleshooting guide
  says; buffered writes, its O_DIRECT default fails here), ``optimizer_step`` under its ``manager.lock()``; needs ``pip install torch-checkpointing==0.1.1 safetensors``
  (skipped with a line when it is not installed);
- ``ts-async``: torchsnapshot's own ``Snapshot.async_take`` of the module and optimizer (no copy of CPU tensors: it
  may save a mixed state; shown for its cost only);
- ``floor``: no training; each rank copies the half of the state it would write and writes it (one file, fsync),
  both ranks at once: the cost of the bytes alone;
- ``floor-beside``: the same bytes beside training (``ElasticFT3D`` without checkpoints; every N steps each rank
  copies its half at the call and a thread at the writer's lowered priority writes it, one file, one fsync): what
  any checkpoint of this state costs the loop on this machine, with no format, checksum or commit.

Repetitions are interleaved (every contender once, then again), and every ratio compares numbers of the same run.
Per contender (median over repetitions): the loop's stall per checkpoint (the step after a save call, less the
median step), extra wall time per checkpoint (``fit`` wall time, the wait for the last save included, less the
baseline's, over the number of checkpoints), time to durable (``ft3d``: ``checkpoint_committed.total_s``), throughput
(steady steps/s against the baseline) and peak extra memory (max RSS over the baseline's, the larger rank).

Run (about 10 minutes on 2 loaded cores; ``--quick``: about 4)::

    python benchmarks/checkpoint_cost.py [--quick] [--size-mb 350] [--steps 60] [--every 10] [--repeats 3]
        [--contenders ft3d lightning-async ...] [--dir /tmp/x] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HIDDEN = 2048
BATCH = 16
WARMUP = 3
CONTENDERS = [
    "none", "none-ft3d", "ft3d", "ft3d-file", "ft3d-folders", "lightning-sync", "lightning-async", "dcp-async",
    "dcp-stager", "torch-ckpt", "ts-async", "floor", "floor-beside",
]  # fmt: skip
PEERS = ("lightning-sync", "lightning-async", "dcp-async", "dcp-stager", "torch-ckpt", "ts-async")
OURS = {"ft3d": "auto", "ft3d-file": "file", "ft3d-folders": "torchsnapshot"}
"""ElasticFT3D's contenders and their ``checkpoint_format``."""
BASELINE = {**dict.fromkeys(OURS, "none-ft3d"), "none-ft3d": "none-ft3d", "floor-beside": "none-ft3d"}


def layers_for(size_mb: float) -> int:
    return max(1, round(size_mb * 1e6 / (3 * 4 * HIDDEN * HIDDEN)))  # weights + Adam's two moments, float32


# -- worker (one per rank, started by torchrun) ----------------------------------------------------------------------


def _floor(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = layers_for(args.size_mb)
    state = [torch.randn(HIDDEN, HIDDEN) for _ in range(3 * n)]
    mine = state[rank::world]
    buffers = [torch.empty_like(t) for t in mine]
    times, cpu = [], []
    for i in range(args.steps // args.every):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        for buf, t in zip(buffers, mine, strict=True):
            buf.copy_(t)
        with open(run_dir / f"floor-{rank}-{i}", "wb") as f:
            for buf in buffers:
                f.write(buf.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        cpu.append(time.process_time() - cpu_start)
        dist.barrier()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {"durable_s": times, "cpu_s": cpu, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def worker(args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    rank = int(os.environ["RANK"])
    if args.contender == "floor":
        result = _floor(args, run_dir)
        (run_dir / f"result-{rank}.json").write_text(json.dumps({"rank": rank, **result}))
        return

    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import ElasticFT3D

    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers_for(args.size_mb))])
            self.step_guard: Any = None  # a peer whose staging runs after its save call guards the in-place update

        def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
            if self.step_guard is None:
                return super().optimizer_step(*args, **kwargs)
            with self.step_guard():
                return super().optimizer_step(*args, **kwargs)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-6)

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())

    class EveryN(Callback):
        """Peers without a Lightning checkpoint IO: save every N steps, wait for the previous save first."""

        def __init__(self, kind: str) -> None:
            self.kind, self.pending, self.group, self.durable = kind, None, None, []

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.group = dist.new_group(backend="gloo")
            self.staging: Any = None
            if self.kind == "dcp-stager":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                options = StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)
                self.stager = DefaultStager(options)
                pl_module.step_guard = self._staged
            if self.kind == "torch-ckpt":
                import torch_checkpointing as tc
                from torch_checkpointing.staging import CheckpointStagerConfig
                from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

                staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False)
                save = tc.AsyncCheckpointSaverConfig(staging_config=staging)
                # O_DIRECT (its default) fails on this machine's filesystem for writes of unaligned size: EINVAL.
                storage = LocalFileSystemStorageConfig(use_direct_io=False)
                self.manager = tc.CheckpointManager(tc.CheckpointManager.Config(save=save, storage_config=storage))
                pl_module.step_guard = self.manager.lock

        @contextlib.contextmanager
        def _staged(self) -> Any:
            if self.staging is not None:
                self.staging.result()
                self.staging = None
            yield

        def _wait(self) -> None:
            if self.pending is not None:
                pending, started = self.pending
                pending.wait() if self.kind == "ts-async" else pending.result()
                self.durable.append(time.perf_counter() - started)  # an upper bound: checked at the next save
                self.pending = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step % args.every:
                return
            self._wait()
            path = run_dir / f"{self.kind}-step={trainer.global_step}"
            started = time.perf_counter()
            state = {"model": pl_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()}
            if self.kind == "dcp-async":
                import torch.distributed.checkpoint as dcp

                self.pending = (dcp.async_save(state, checkpoint_id=str(path), process_group=self.group), started)
            elif self.kind == "dcp-stager":
                import torch.distributed.checkpoint as dcp

                response = dcp.async_save(
                    state, checkpoint_id=str(path), process_group=self.group, async_stager=self.stager
                )
                self.staging = response.staging_completion
                self.pending = (response.upload_completion, started)
            elif self.kind == "torch-ckpt":
                self.pending = (self.manager.save(str(path), state), started)
            else:
                from torchsnapshot import Snapshot

                app_state = {"model": pl_module, "optimizer": trainer.optimizers[0]}
                self.pending = (Snapshot.async_take(str(path), app_state=app_state, pg=self.group), started)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._wait()
            if self.kind == "torch-ckpt":
                self.manager.close()
            if self.kind == "dcp-stager":
                self.stager.close()

    blocked: dict[int, float] = {}  # step -> seconds the loop was blocked by the save issued at that step

    def timed_hook(hook: Any) -> Any:
        def timed(trainer: Any, *rest: Any) -> Any:
            step, start = trainer.global_step, time.perf_counter()
            try:
                return hook(trainer, *rest)
            finally:
                if not step % args.every:
                    blocked[step] = blocked.get(step, 0.0) + time.perf_counter() - start

        return timed

    class FloorBeside(Callback):
        """The bytes alone, beside training: every N steps copy this rank's half of the state into reused buffers and
        write it (one file, one fsync) from a thread at the writer's lowered priority; no format, no commit."""

        def __init__(self) -> None:
            self.buffers: list[torch.Tensor] | None = None
            self.thread: Any = None

        def _write(self, path: Path) -> None:
            from lightning_ft.checkpoint.writer_threads import lower_thread_priority

            lower_thread_priority(19)
            with open(path, "wb") as f:
                for buf in self.buffers or []:
                    f.write(buf.numpy().data)
                f.flush()
                os.fsync(f.fileno())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            import threading

            if trainer.global_step % args.every:
                return
            self.on_train_end(trainer, pl_module)
            optimizer = trainer.optimizers[0]
            tensors = [p.detach() for p in pl_module.parameters()]
            tensors += [v for st in optimizer.state.values() for v in st.values() if v.numel() > 1]
            mine = tensors[rank::2]
            if self.buffers is None:
                self.buffers = [torch.empty_like(t) for t in mine]
            for buf, t in zip(self.buffers, mine, strict=True):
                buf.copy_(t)
            path = run_dir / f"floor-beside-{rank}-{trainer.global_step}"
            self.thread = threading.Thread(target=self._write, args=(path,))
            self.thread.start()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.thread is not None:
                self.thread.join()
                self.thread = None

    kind = args.contender
    timer = StepTimes()
    callbacks: list[Any] = [timer]
    plugins: list[Any] = []
    checkpointing = kind in (*OURS, "lightning-sync", "lightning-async")
    if checkpointing:
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "ckpt", every_n_train_steps=args.every, save_top_k=-1))
    if kind == "lightning-async":
        plugins.append(AsyncCheckpointIO())
    if kind in ("dcp-async", "dcp-stager", "torch-ckpt", "ts-async"):
        callbacks.append(EveryN(kind))
    if kind == "floor-beside":
        callbacks.append(FloorBeside())
    for cb in callbacks[1:]:  # the save call with everything Lightning and the contender do around it
        cb.on_train_batch_end = timed_hook(cb.on_train_batch_end)
    if kind in OURS:
        strategy = ElasticFT3D(checkpoint_format=OURS[kind])
    else:
        strategy = ElasticFT3D() if kind in ("none-ft3d", "floor-beside") else DDPStrategy()
    data = TensorDataset(torch.randn(BATCH * 2 * (args.steps + 1), HIDDEN))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=plugins or None,
        max_steps=args.steps,
        callbacks=callbacks,
        enable_checkpointing=checkpointing,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(Net(), DataLoader(data, batch_size=BATCH))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    durable: list[float] = []
    save_calls: list[float] = []
    events = run_dir / "lightning-ft" / "events" / "rank0.jsonl"
    if rank == 0 and events.exists():
        for line in events.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "checkpoint_committed":
                durable.append(record["total_s"])
                save_calls.append(record["stall_s"])
    for cb in callbacks:
        if isinstance(cb, EveryN):
            durable = cb.durable
    result = {
        "rank": rank,
        "wall_s": wall,
        "cpu_s": cpu,
        "blocked_s": [blocked[k] for k in sorted(blocked)],
        "ends": timer.ends,
        "durable_s": durable,
        "save_call_s": save_calls,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (run_dir / f"result-{rank}.json").write_text(json.dumps(result))  # stdout: the ranks' lines interleave


# -- driver ----------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args: argparse.Namespace, contender: str, root: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=root))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
        __file__, "--worker", "--contender", contender, "--run-dir", str(run_dir),
        "--size-mb", str(args.size_mb), "--steps", str(args.steps), "--every", str(args.every),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    results = [json.loads(f.read_text()) for f in sorted(run_dir.glob("result-*.json"))]
    shutil.rmtree(run_dir, ignore_errors=True)
    if out.returncode != 0 or len(results) != 2:
        raise RuntimeError(f"{contender} failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return {r["rank"]: r for r in results}


def summarize(contender: str, runs: list[dict[int, dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    saves = args.steps // args.every
    if contender == "floor":
        durable = [statistics.median(r[0]["durable_s"]) for r in runs]
        cpu = [sum(statistics.median(r[k]["cpu_s"]) for k in r) for r in runs]  # both ranks' CPU, per checkpoint
        return {
            "durable_s": statistics.median(durable),
            "cpu_s": statistics.median(cpu),
            "maxrss_mb": max(r[k]["maxrss_mb"] for r in runs for k in r),
        }
    walls, stalls, rates, cpus, blocked = [], [], [], [], []
    for r in runs:
        walls.append(max(r[k]["wall_s"] for k in r))
        cpus.append(sum(r[k]["cpu_s"] for k in r))
        if r[0].get("blocked_s"):
            blocked.append(statistics.median(r[0]["blocked_s"][1:] or r[0]["blocked_s"]))  # the first save allocates
        ends = r[0]["ends"]
        intervals = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]  # intervals[i] ends at step i + 2
        after_save = {s for s in range(args.every, args.steps, args.every)}  # the step whose interval holds a save
        normal = [d for i, d in enumerate(intervals) if i + 1 not in after_save and i >= WARMUP]
        typical = statistics.median(normal)
        if contender not in ("none", "none-ft3d"):
            stalls.append(statistics.median(intervals[s - 1] - typical for s in after_save if s - 1 < len(intervals)))
        rates.append((len(ends) - 1 - WARMUP) / (ends[-1] - ends[WARMUP]))
    durable = [d for r in runs for d in r[0]["durable_s"][1:]]  # the first save allocates
    save_calls = [d for r in runs for d in r[0].get("save_call_s", [])[1:]]
    return {
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "blocked_s": statistics.median(blocked) if blocked else None,
        "stall_s": statistics.median(stalls) if stalls else 0.0,
        "steps_per_s": statistics.median(rates),
        "durable_s": statistics.median(durable) if durable else None,
        "save_call_s": statistics.median(save_calls) if save_calls else None,
        "maxrss_mb": max(r[k]["maxrss_mb"] for r in runs for k in r),
        "saves": saves,
    }


def print_table(args: argparse.Namespace, results: dict[str, dict[str, Any]], load: str) -> None:
    n = layers_for(args.size_mb)
    size = 3 * 4 * HIDDEN * HIDDEN * n / 1e6
    print(
        f"\nstate {size:.0f} MB (weights + Adam), 2 ranks, {args.steps} steps, a checkpoint every {args.every},"
        f" median of {args.repeats} interleaved repetitions; load average at start {load}"
    )
    floor = results.get("floor", {}).get("durable_s")
    peers = [c for c in results if c in PEERS]
    extra = {}
    for c, r in results.items():
        if c == "floor" or c.startswith("none"):
            continue
        base = results.get(BASELINE.get(c, "none"))
        extra[c] = (r["wall_s"] - base["wall_s"]) / r["saves"] if base else None
    cpu = {}
    for c, r in results.items():
        base = results.get(BASELINE.get(c, "none"))
        if c != "floor" and not c.startswith("none") and base:
            cpu[c] = (r["cpu_s"] - base["cpu_s"]) / r["saves"]
    best_blocked = min((results[c]["blocked_s"] for c in peers if results[c].get("blocked_s")), default=None)
    best_stall = min((results[c]["stall_s"] for c in peers), default=None)
    best_extra = min((extra[c] for c in peers if extra[c] is not None), default=None)
    print(
        "| contender | loop blocked/ckpt ms | step after a save ms | extra wall/ckpt ms | CPU/ckpt ms | durable ms"
        " | throughput vs none | peak extra MB |"
    )
    print("|" + "---|" * 8)
    for c, r in results.items():
        if c == "floor":
            continue
        base = results.get(BASELINE.get(c, "none"))
        through = r["steps_per_s"] / base["steps_per_s"] if base else float("nan")
        mem = r["maxrss_mb"] - base["maxrss_mb"] if base else float("nan")
        ex = f"{extra[c] * 1e3:.0f}" if extra.get(c) is not None else "-"
        dur = f"{r['durable_s'] * 1e3:.0f}" if r.get("durable_s") else "-"
        stall = f"{r['stall_s'] * 1e3:.0f}" if not c.startswith("none") else "-"
        blocked = f"{r['blocked_s'] * 1e3:.1f}" if r.get("blocked_s") is not None else "-"
        used = f"{cpu[c] * 1e3:.0f}" if c in cpu else "-"
        print(f"| {c} | {blocked} | {stall} | {ex} | {used} | {dur} | {through:.1%} | {mem:.0f} |")
    if floor is not None:
        floor_cpu = results["floor"]["cpu_s"]
        print(
            f"| floor (copy + write + fsync, both ranks, nothing else running) | - | - | - | {floor_cpu * 1e3:.0f}"
            f" | {floor * 1e3:.0f} | - | - |"
        )
    for ours in [c for c in OURS if c in results]:
        ft = results[ours]
        base = results.get("none-ft3d")
        print(f"\nratios (same run), {ours} (checkpoint_format={OURS[ours]!r}):")
        if best_blocked and ft.get("blocked_s") is not None:
            print(f"  loop blocked / best peer's         {ft['blocked_s'] / best_blocked:.2f}  (goal <= 0.1)")
        if best_stall:
            print(f"  step after a save / best peer's    {ft['stall_s'] / best_stall:.2f}")
        if best_extra and extra.get(ours) is not None:
            print(f"  extra wall / best peer's           {extra[ours] / best_extra:.2f}  (goal <= 0.5)")
        if floor and extra.get(ours) is not None:
            print(f"  extra wall / floor                 {extra[ours] / floor:.2f}  (goal <= 1.5)")
        if extra.get("floor-beside") and extra.get(ours) is not None:
            print(f"  extra wall / floor beside training {extra[ours] / extra['floor-beside']:.2f}")
        if floor is not None and ours in cpu:
            print(f"  CPU / floor's CPU                  {cpu[ours] / results['floor']['cpu_s']:.2f}")
        if cpu.get("floor-beside") and ours in cpu:
            print(f"  CPU / floor beside training's CPU  {cpu[ours] / cpu['floor-beside']:.2f}")
        beside = results.get("floor-beside")
        if beside and base:
            print(f"  floor beside training throughput / none {beside['steps_per_s'] / base['steps_per_s']:.3f}")
        if ft.get("save_call_s") is not None:
            print(f"  save call (checkpoint_committed.stall_s) {ft['save_call_s'] * 1e3:.1f} ms")
        if base:
            print(f"  throughput / none                  {ft['steps_per_s'] / base['steps_per_s']:.3f}  (goal >= 0.95)")
    if extra.get("ft3d-file") is not None and extra.get("ft3d-folders"):
        print(
            f"\n  file / folders extra wall           {extra['ft3d-file'] / extra['ft3d-folders']:.2f}  (goal <= 1.1)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="100 MB, 60 steps, 2 repetitions")
    parser.add_argument("--size-mb", type=float, default=350.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.size_mb, args.steps, args.repeats = 100.0, 60, 2
    if "torch-ckpt" in args.contenders and importlib.util.find_spec("torch_checkpointing") is None:
        print("torch-ckpt skipped: pip install torch-checkpointing==0.1.1 safetensors to include it", flush=True)
        args.contenders = [c for c in args.contenders if c != "torch-ckpt"]
    load = os.getloadavg()
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {c: [] for c in args.contenders}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.repeats):
            for contender in args.contenders:
                started = time.perf_counter()
                runs[contender].append(run_once(args, contender, Path(tmp)))
                print(f"  [{rep + 1}/{args.repeats}] {contender}: {time.perf_counter() - started:.0f} s", flush=True)
                if args.json:  # the raw runs so far, so that a failure late in a long run loses nothing
                    args.json.with_suffix(".runs.json").write_text(json.dumps(runs))
    results = {c: summarize(c, r, args) for c, r in runs.items()}
    print_table(args, results, " ".join(f"{x:.2f}" for x in load))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"dir": None, "json": None}, "results": results}))


if __name__ == "__main__":
    main()
