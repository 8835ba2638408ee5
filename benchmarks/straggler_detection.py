"""Detection harness for the straggler detector: synthetic per-rank step times, 8 to 1024 ranks.

Feeds :class:`lightning_ft.monitors.straggler_detector.StragglerDetector` the same per-window statistic that
``StragglerMonitor`` gathers (each rank's median own step time over ``interval`` steps) and prints, per fleet size and
jitter model:

- detection latency: steps from the onset of a slowdown on one rank to the window that names it;
- false positives per 10,000 steps: ranks named in runs where no rank is slow.

Goals: a rank 20% slower is named within 50 steps; no false positive in 10,000 steps at +-10% jitter, at 8 and 1024
ranks. Run: ``python benchmarks/straggler_detection.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from lightning_ft.monitors.straggler_detector import DetectorConfig, StragglerDetector

BASE_MS = 100.0
WARMUP_STEPS = 10


def jitter(model: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Multiplicative per-step, per-rank noise."""
    if model == "uniform10":  # +-10%, flat
        return rng.uniform(0.9, 1.1, shape)
    if model == "gauss5":  # sigma 5%: +-10% is two sigma, tails unbounded
        return rng.normal(1.0, 0.05, shape)
    if model == "stalls":  # +-10% plus one-off stalls: 1% of steps 3x on one rank, a fleet-wide pause every 500 steps
        noise = rng.uniform(0.9, 1.1, shape)
        noise[rng.random(shape) < 0.01] *= 3.0
        noise[::500, :] *= 5.0
        return noise
    if model == "biased":  # +-10% plus a fixed per-rank bias of up to +-5% (mixed hardware)
        return rng.uniform(0.9, 1.1, shape) * rng.uniform(0.95, 1.05, (1, shape[1]))
    raise ValueError(f"unknown jitter model {model!r}")


def simulate(
    ranks: int, steps: int, model: str, *, slow_rank: int | None, onset: int, slowdown: float, interval: int, seed: int
) -> list:
    """All detections of one synthetic run."""
    rng = np.random.default_rng(seed)
    times = BASE_MS * jitter(model, rng, (steps, ranks))
    if slow_rank is not None:
        times[onset:, slow_rank] *= slowdown
    detector = StragglerDetector(DetectorConfig())
    detections = []
    first = WARMUP_STEPS
    usable = (steps - first) // interval * interval
    windows = np.median(times[first : first + usable].reshape(-1, interval, ranks), axis=1)
    for w, medians in enumerate(windows):
        end_step = first + (w + 1) * interval - 1
        detections.extend(detector.update(medians.tolist(), step=end_step, steps=interval).detections)
    return detections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer fleet sizes and trials")
    parser.add_argument("--fp-runs", type=int, default=3, help="10,000-step runs without a slow rank per case")
    parser.add_argument("--interval", type=int, default=8, help="steps per window (StragglerMonitor(interval=...))")
    args = parser.parse_args()
    fleet_sizes = [8, 1024] if args.quick else [8, 64, 256, 1024]
    models = ["uniform10", "gauss5", "stalls", "biased"]
    trials = 3 if args.quick else 8
    cfg = DetectorConfig()
    print(f"detector: {cfg}, interval={args.interval}, warmup={WARMUP_STEPS} steps, slowdown 1.20")
    print(f"{trials} onsets per case; false positives over {args.fp_runs} runs of 10,000 steps without a slow rank")
    print(f"{'ranks':>6} {'jitter':>10} {'latency steps (median/max)':>28} {'missed':>7} {'FP per 10k steps':>17}")
    started = time.perf_counter()
    worst_latency = 0
    worst_fp = 0.0
    for ranks in fleet_sizes:
        for model in models:
            latencies, missed = [], 0
            for t in range(trials):
                onset = 200 + 37 * t  # onsets land at every phase of the window
                slow = (7 * t + 3) % ranks
                hits = [
                    d.step - onset
                    for d in simulate(
                        ranks,
                        onset + 300,
                        model,
                        slow_rank=slow,
                        onset=onset,
                        slowdown=1.2,
                        interval=args.interval,
                        seed=t,
                    )
                    if d.rank == slow and d.step >= onset
                ]
                if hits:
                    latencies.append(hits[0])
                else:
                    missed += 1
            false = sum(
                len(
                    simulate(
                        ranks, 10_000, model, slow_rank=None, onset=0, slowdown=1.0, interval=args.interval, seed=s
                    )
                )
                for s in range(100, 100 + args.fp_runs)
            )
            fp = false * 10_000 / ((10_000 - WARMUP_STEPS) * args.fp_runs)
            worst_fp = max(worst_fp, fp)
            worst_latency = max([worst_latency, *latencies])
            lat = f"{statistics.median(latencies):.0f}/{max(latencies)}" if latencies else "-"
            print(f"{ranks:>6} {model:>10} {lat:>28} {missed:>7} {fp:>17.2f}")
    print(
        f"worst detection latency: {worst_latency} steps (goal <= 50); worst false positives: {worst_fp:.2f} per 10k "
        f"steps (goal 0); {time.perf_counter() - started:.0f}s"
    )
    print(
        f"StragglerMonitor acts one window later than the detector (its gather overlaps the next window): worst"
        f" {worst_latency + args.interval} steps in a live run"
    )


if __name__ == "__main__":
    main()
