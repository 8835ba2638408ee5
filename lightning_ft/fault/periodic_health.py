"""Periodic health checks: the pre-flight collective and GPU checks again, every N optimizer steps during training.

At a step boundary that every rank reaches together (``trainer.global_step`` a multiple of
``FaultPolicy.health_check_every_n_steps``) every rank runs, in the same order, the same collectives:

- ``collective``: the round trip of a one-element all-reduce and the bus bandwidth of a sized one (4 MiB on CPUs,
  64 MiB on GPUs, as before the first step), compared with the :class:`CollectiveTiming` the pre-flight check
  measured. The group's values are the medians over the ranks. When the round trip grew, or the bandwidth fell, by
  more than ``FaultPolicy.health_check_slowdown`` times, the measurement is repeated once (a transient stall
  passes); when it holds, :func:`ping_links` times point-to-point round trips on the pairs of :func:`link_pairs` to
  name the slow rank (:func:`slow_ranks`). The all-reduce's values are checked as well.
- ``gpu``: NVML, on CUDA devices: uncorrected ECC errors, a retired page or row remap pending, a failed remap, a
  hardware slowdown (thermal, power brake; the software caps are normal under load).

Then every rank gathers every rank's results (one ``all_gather_object``), so every rank holds the same failures and
takes the same action. :class:`PeriodicHealthCheck` keeps the baseline and runs one check; the
:class:`~lightning_ft.fault.fault_handler.FaultHandler` schedules it and acts on its result.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_ft.fault import health
from lightning_ft.fault.health import Failure


@dataclass(frozen=True)
class CollectiveTiming:
    """The collective as the group measured it (the medians over the ranks): at the pre-flight check, the baseline
    of the periodic ones."""

    latency_s: float
    """Seconds of a one-element all-reduce round trip."""

    busbw_gbps: float
    """Bus bandwidth of the sized all-reduce, GB/s."""

    @classmethod
    def from_infos(cls, infos: Sequence[dict[str, Any]]) -> CollectiveTiming | None:
        """From every rank's ``allreduce_latency_s`` and ``allreduce_busbw_gbps`` (``None`` on one rank)."""
        latency = [i["allreduce_latency_s"] for i in infos if i.get("allreduce_latency_s") is not None]
        busbw = [i["allreduce_busbw_gbps"] for i in infos if i.get("allreduce_busbw_gbps") is not None]
        if not latency or not busbw:
            return None
        return cls(latency_s=statistics.median(latency), busbw_gbps=statistics.median(busbw))


@dataclass(frozen=True)
class Degradation:
    """How much slower the group's collective is than its baseline (ratios > 1 are slower)."""

    latency_ratio: float
    busbw_ratio: float
    """CollectiveTiming bandwidth over the measured one."""

    def exceeds(self, slowdown: float) -> bool:
        return self.latency_ratio > slowdown or self.busbw_ratio > slowdown

    def describe(self, baseline: CollectiveTiming, measured: CollectiveTiming) -> str:
        return (
            f"all-reduce round trip {measured.latency_s * 1e3:.3g} ms ({self.latency_ratio:.1f}x the pre-flight"
            f" {baseline.latency_s * 1e3:.3g} ms), bus bandwidth {measured.busbw_gbps:.3g} GB/s"
            f" ({1 / self.busbw_ratio:.2f}x the pre-flight {baseline.busbw_gbps:.3g} GB/s)"
        )


def degradation(baseline: CollectiveTiming, measured: CollectiveTiming) -> Degradation:
    """``measured`` relative to ``baseline``."""
    return Degradation(
        latency_ratio=measured.latency_s / baseline.latency_s,
        busbw_ratio=baseline.busbw_gbps / max(measured.busbw_gbps, 1e-12),
    )


def link_pairs(world_size: int) -> list[tuple[int, int]]:
    """The rank pairs whose round trips :func:`ping_links` times: rank 0 with every other rank, and ranks 1 and 2
    (so that a slow rank 0, which slows every pair with it, is told apart from a slow fabric). ``world_size`` pings,
    sequential on rank 0; they run only after the group's collective was found slow twice."""
    pairs = [(0, r) for r in range(1, world_size)]
    if world_size >= 3:
        pairs.append((1, 2))
    return pairs


def ping_links(rank: int, world_size: int, device: torch.device, numel: int) -> dict[tuple[int, int], float]:
    """Round trips of a one-element and a ``numel``-element tensor, send and receive, on each pair of
    :func:`link_pairs` that holds ``rank``; seconds, the fastest of two after a warm-up, as measured by the pair's
    first rank (the others return nothing for it).

    Collective in effect: every rank must call it at the same point (a rank waits in its pairs for its peers).
    """
    small = torch.zeros(1, dtype=torch.float32, device=device)
    large = torch.zeros(numel, dtype=torch.float32, device=device)
    times: dict[tuple[int, int], float] = {}
    for first, second in link_pairs(world_size):
        if rank not in (first, second):
            continue
        peer = second if rank == first else first
        best = float("inf")
        for i in range(3):
            health.sync(device)
            start = time.perf_counter()
            for buffer in (small, large):
                if rank == first:
                    dist.send(buffer, peer)
                    dist.recv(buffer, peer)
                else:
                    dist.recv(buffer, peer)
                    dist.send(buffer, peer)
            health.sync(device)
            if i:
                best = min(best, time.perf_counter() - start)
        if rank == first:
            times[(first, second)] = best
    return times


def slow_ranks(times: dict[tuple[int, int], float], world_size: int, slowdown: float) -> tuple[list[int], str]:
    """The ranks to name for a slow collective, from the pair round trips, and why.

    A pair is slow when its round trip is more than ``slowdown`` times the fastest pair's. A rank is named when every
    pair it is in is slow (and some pair is not); when that holds for rank 0, rank 0 alone is named (its slow links
    explain every slow pair; a rank linked to rank 0 only cannot be told apart from it). Two ranks cannot be told
    apart (one pair); when no pair stands out (a slow fabric, or a slowdown of the all-reduce only), every rank is
    named.
    """
    ranks = list(range(world_size))
    if not times:
        return ranks, "no link to time"
    fastest = min(times.values())
    slow = {pair for pair, t in times.items() if t > slowdown * fastest}
    shown = ", ".join(f"{a}-{b} {t * 1e3:.3g} ms" for (a, b), t in sorted(times.items()))
    if world_size == 2:
        return ranks, f"two ranks cannot be told apart (round trip {shown})"
    if not slow:
        return ranks, f"no link stands out (round trips {shown})"
    named = [r for r in ranks if all(pair in slow for pair in times if r in pair)]
    named = [0] if 0 in named else named
    if not named:
        return ranks, f"no single rank is in every slow link (round trips {shown})"
    return named, f"every link of this rank is slower than {slowdown:g}x the fastest (round trips {shown})"


@dataclass
class PeriodicHealthCheck:
    """The periodic checks of one ``fit``: the baseline, then one :meth:`run` per check step.

    Args:
        slowdown: ``FaultPolicy.health_check_slowdown``.
        nvml: for the ``gpu`` check (``None``: the real one on CUDA devices; tests pass a ``FakeNVML``).
    """

    slowdown: float
    nvml: Any = None
    baseline: CollectiveTiming | None = None
    last: dict[str, Any] = field(default_factory=dict)
    """What the latest :meth:`run` measured (the fields of its event)."""

    def run(self, rank: int, world_size: int, device: torch.device) -> list[Failure]:
        """One periodic check; every rank's failures, the same list on every rank.

        Collective on the default group: every rank calls it at the same step boundary. Without a baseline (no
        pre-flight check) this one's collective measurement becomes it.
        """
        started = time.perf_counter()
        failures, measured = self._measure(rank, world_size, device)
        failures += health.check_gpu(rank, device, self.nvml, at_rest=False)
        failures, infos = health.exchange(failures, {"rank": rank, **_fields(measured)})
        group = CollectiveTiming.from_infos(infos)
        fields: dict[str, Any] = {**_fields(group), "baseline": None, "slowdown": None}
        collective_failures: list[Failure] = []
        if group is not None and self.baseline is None:
            self.baseline = group
        elif group is not None and self.baseline is not None:
            fields["baseline"] = _fields(self.baseline)
            worse = degradation(self.baseline, group)
            if worse.exceeds(self.slowdown):
                # Once more before naming anyone: a stall of one measurement (a page fault, a busy core) passes.
                again, measured = self._measure(rank, world_size, device)
                again, infos = health.exchange(again, {"rank": rank, **_fields(measured)})
                failures += again
                group = CollectiveTiming.from_infos(infos) or group
                worse = degradation(self.baseline, group)
                fields.update(_fields(group))
            fields["slowdown"] = {"latency": worse.latency_ratio, "busbw": worse.busbw_ratio}
            if worse.exceeds(self.slowdown):
                own = ping_links(rank, world_size, device, health.collective_numel(device))
                _, gathered = health.exchange([], {"rank": rank, "times": sorted(own.items())})
                times = {tuple(pair): t for info in gathered for pair, t in info["times"]}
                named, why = slow_ranks(times, world_size, self.slowdown)
                detail = f"{worse.describe(self.baseline, group)}; {why}"
                collective_failures = [Failure(r, "collective", detail) for r in named]
        self.last = {**fields, "duration_s": time.perf_counter() - started}
        return _unique(failures + collective_failures)

    def _measure(
        self, rank: int, world_size: int, device: torch.device
    ) -> tuple[list[Failure], CollectiveTiming | None]:
        wrong, busbw = health.check_collective(rank, world_size, device)
        latency = health.measure_latency(world_size, device)
        if busbw is None or latency is None:
            return wrong, None
        return wrong, CollectiveTiming(latency_s=latency, busbw_gbps=busbw)


def _fields(measured: CollectiveTiming | None) -> dict[str, Any]:
    if measured is None:
        return {"allreduce_latency_s": None, "allreduce_busbw_gbps": None}
    return {"allreduce_latency_s": measured.latency_s, "allreduce_busbw_gbps": measured.busbw_gbps}


def _unique(failures: list[Failure]) -> list[Failure]:
    seen: dict[tuple[int, str, str], Failure] = {}
    for failure in failures:
        seen.setdefault((failure.rank, failure.check, failure.detail), failure)
    return list(seen.values())
