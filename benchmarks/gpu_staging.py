"""What lightning-ft's GPU paths cost and whether they hold, on one CUDA device; prints one table.

- staging: ``AsyncCheckpointer.save()`` on CUDA tensors (a non-blocking copy of every tensor into a pinned host buffer,
  reused from one save to the next, then a synchronize) against the bare floor: the same copies into pinned buffers
  allocated beforehand, on the current stream and on a side stream, and a copy into pageable memory. Milliseconds
  per GB, and each as a ratio to the pinned floor on the current stream; the first save (which allocates the pinned
  buffers) separately.
- CUDA RNG: the RNG states the strategy saves per rank (``_compat.collect_rng_states``) hold every CUDA generator;
  written through a checkpoint, loaded back and set (``_compat.set_rng_states``), CUDA dropout draws the same mask.
- NVML: one real reading of the device through the seam ThermalMonitor reads (``lightning_ft.nvml.NVML``), its time, and
  the pre-flight ``gpu`` health check (``fault.health.check_gpu``) on it.
- monitors: a Lightning run on the device (an MLP whose step takes about 15 ms on a current GPU) with no monitors and
  with StragglerMonitor (which times steps with CUDA events), ThermalMonitor (real NVML) and GoodputMonitor,
  repetitions interleaved; the step time of each and the overhead ``all / none - 1``.

Run: ``python benchmarks/gpu_staging.py [--size-gb 1] [--repeats 5] [--steps 150] [--dir /tmp/x]`` (about 2 minutes
on one GPU; ``scripts/gpu_check.sh`` runs it after the gpu-marked tests). Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GB = 1e9
TENSOR_BYTES = 64 << 20


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def staging(size_gb: float, repeats: int, root: Path) -> list[tuple[str, str, str]]:
    from lightning_ft.checkpoint import AsyncCheckpointer

    count = max(1, int(size_gb * GB) // TENSOR_BYTES)
    state = {f"layer{i}.weight": torch.randn(TENSOR_BYTES // 4, device="cuda") for i in range(count)}
    nbytes = count * TENSOR_BYTES
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]
    pageable = [torch.empty(t.shape, dtype=t.dtype) for t in state.values()]
    side = torch.cuda.Stream()

    def pinned_copy() -> None:
        for buf, t in zip(pinned, state.values(), strict=True):
            buf.copy_(t, non_blocking=True)
        torch.cuda.synchronize()

    def side_stream_copy() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for buf, t in zip(pinned, state.values(), strict=True):
                buf.copy_(t, non_blocking=True)
        side.synchronize()

    def pageable_copy() -> None:
        for buf, t in zip(pageable, state.values(), strict=True):
            buf.copy_(t)

    floor = _median_ms(pinned_copy, repeats)
    side_ms = _median_ms(side_stream_copy, repeats)
    pageable_ms = _median_ms(pageable_copy, repeats)
    pinned.clear()  # free the floor's host memory before the checkpointer allocates its own
    pageable.clear()

    checkpointer = AsyncCheckpointer()
    stalls = []
    try:
        for i in range(repeats + 1):
            for t in state.values():
                t.add_(1.0)  # the training step
            torch.cuda.synchronize()
            start = time.perf_counter()
            checkpointer.save(root / f"step={i}", {"model": state}, metadata={"step": i})
            stalls.append((time.perf_counter() - start) * 1e3)
            checkpointer.wait()
    finally:
        checkpointer.close()
    steady = statistics.median(stalls[1:])
    per_gb = GB / nbytes

    def row(name: str, ms: float) -> tuple[str, str, str]:
        return (name, f"{ms * per_gb:.1f} ms/GB", f"{ms / floor:.2f}x the pinned floor")

    return [
        row(f"staging: save() stall, steady ({nbytes / GB:.2f} GB, median of {repeats})", steady),
        row("staging: save() stall, first (allocates the pinned buffers)", stalls[0]),
        row("staging: bare pinned copy, current stream (the floor)", floor),
        row("staging: bare pinned copy, side stream", side_ms),
        row("staging: copy into pageable memory", pageable_ms),
    ]


def cuda_rng(root: Path) -> list[tuple[str, str, str]]:
    from lightning_ft import _compat
    from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint

    torch.cuda.manual_seed_all(1234)
    x = torch.ones(1 << 20, device="cuda")
    torch.nn.functional.dropout(x, 0.5)  # the generator has moved on from its seed
    states = _compat.collect_rng_states()
    cuda_states = states.get("torch.cuda", [])
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(root / "rng", {"x": torch.zeros(1)}, rank_state={"rng": states})
        checkpointer.wait()
    finally:
        checkpointer.close()
    expected = torch.nn.functional.dropout(x, 0.5)
    torch.nn.functional.dropout(x, 0.5)  # training went on after the save
    _compat.set_rng_states(load_checkpoint(root / "rng").rank_state["rng"])
    again = torch.nn.functional.dropout(x, 0.5)
    exact = torch.equal(expected, again)
    return [
        (
            "CUDA RNG: generators in the saved states",
            f"{len(cuda_states)} of {torch.cuda.device_count()}",
            "" if len(cuda_states) == torch.cuda.device_count() else "MISSING",
        ),
        ("CUDA RNG: dropout mask after restore from a checkpoint", "equal" if exact else "DIFFERS", ""),
    ]


def nvml() -> list[tuple[str, str, str]]:
    from lightning_ft.fault.health import check_gpu, nvml_index
    from lightning_ft.nvml import NVML, NVMLUnavailable, decode_reasons

    reader = NVML()
    index = nvml_index(torch.cuda.current_device())
    try:
        reader.init()
    except NVMLUnavailable as err:
        return [("NVML", f"unavailable: {err}", "")]
    try:
        reading = reader.read(index)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            reader.read(index)
            times.append(time.perf_counter() - start)
    finally:
        reader.shutdown()

    def value(name: str, unit: str) -> str:
        v = reading.get(name)
        return "unsupported" if v is None else f"{v:.0f} {unit}"

    reasons = decode_reasons(int(reading.get("reasons_bits") or 0)) or ["none"]
    failures = check_gpu(0, torch.device("cuda", torch.cuda.current_device()))
    return [
        (
            f"NVML device {index}: temperature",
            value("temperature_c", "C"),
            f"slowdown at {value('slowdown_temperature_c', 'C')}",
        ),
        ("NVML: SM clock", value("sm_clock_mhz", "MHz"), f"max {value('max_sm_clock_mhz', 'MHz')}"),
        ("NVML: power", value("power_w", "W"), f"limit {value('power_limit_w', 'W')}"),
        ("NVML: clock-event reasons", ", ".join(reasons), ""),
        ("NVML: one reading (median of 20)", f"{statistics.median(times) * 1e3:.2f} ms", ""),
        ("health check gpu", "passed" if not failures else "; ".join(f.detail for f in failures), ""),
    ]


def _fit_ms_per_step(monitors: bool, steps: int, root: Path) -> float:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import ElasticFT3D, GoodputMonitor, StragglerMonitor, ThermalMonitor

    warmup = 20

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    class Clock(Callback):
        start = end = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == warmup:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            torch.cuda.synchronize()
            self.end = time.perf_counter()

    clock = Clock()
    callbacks: list[Any] = [clock]
    if monitors:
        callbacks += [StragglerMonitor(), ThermalMonitor(), GoodputMonitor()]
    data = TensorDataset(torch.randn(2048 * 4, 4096))
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=ElasticFT3D(),
        max_steps=warmup + steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=2048, pin_memory=True))
    return (clock.end - clock.start) / steps * 1e3


def monitor_overhead(steps: int, repeats: int, root: Path) -> list[tuple[str, str, str]]:
    import torch.distributed as dist

    off, on = [], []
    for i in range(repeats):
        for monitors, out in ((False, off), (True, on)) if i % 2 == 0 else ((True, on), (False, off)):
            out.append(_fit_ms_per_step(monitors, steps, root / f"fit{i}-{int(monitors)}"))
            if dist.is_initialized():
                dist.destroy_process_group()
    none_ms, all_ms = statistics.median(off), statistics.median(on)
    return [
        (f"monitors: step, none (median of {repeats} runs of {steps} steps)", f"{none_ms:.2f} ms", ""),
        ("monitors: step, StragglerMonitor + ThermalMonitor + GoodputMonitor", f"{all_ms:.2f} ms", ""),
        ("monitors: overhead", f"{(all_ms / none_ms - 1) * 100:+.2f}%", "goal: under 1%"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state staged per save, in GB")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of each staging measurement")
    parser.add_argument("--steps", type=int, default=150, help="measured training steps per monitor run")
    parser.add_argument("--monitor-repeats", type=int, default=3, help="runs with and without monitors, each")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    if args.size_gb <= 0 or args.repeats < 1 or args.steps < 1 or args.monitor_repeats < 1:
        parser.error("--size-gb must be > 0; --repeats, --steps and --monitor-repeats must be >= 1")
    if not torch.cuda.is_available():
        print(f"benchmarks/gpu_staging.py needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        rows += staging(args.size_gb, args.repeats, root / "staging")
        rows += cuda_rng(root)
        rows += nvml()
        rows += monitor_overhead(args.steps, args.monitor_repeats, root / "monitors")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("| measure | value | against |")
    print("|---|---|---|")
    for name, value, against in rows:
        print(f"| {name} | {value} | {against} |")
    # A broken guarantee (not a slow number) fails the run.
    return 1 if any("DIFFERS" in r[1] or "MISSING" in r[2] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
