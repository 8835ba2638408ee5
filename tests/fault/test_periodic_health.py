"""Periodic health checks: the decision from measured numbers, the rank a slow link names, and one check on 3 gloo
ranks with a real delay on one rank's sends, the same report on every rank."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_ft import _compat
from lightning_ft.fault.periodic_health import (
    CollectiveTiming,
    PeriodicHealthCheck,
    degradation,
    link_pairs,
    slow_ranks,
)
from lightning_ft.nvml import FakeNVML
from tests.helpers import run_distributed

BASE = CollectiveTiming(latency_s=0.001, busbw_gbps=1.0)


def test_the_group_values_are_the_medians_over_the_ranks_and_one_rank_has_none():
    infos = [
        {"allreduce_latency_s": 0.001, "allreduce_busbw_gbps": 2.0},
        {"allreduce_latency_s": 0.009, "allreduce_busbw_gbps": 1.0},
        {"allreduce_latency_s": 0.002, "allreduce_busbw_gbps": 3.0},
    ]
    assert CollectiveTiming.from_infos(infos) == CollectiveTiming(latency_s=0.002, busbw_gbps=2.0)
    assert CollectiveTiming.from_infos([{"allreduce_latency_s": None, "allreduce_busbw_gbps": None}]) is None


@pytest.mark.parametrize(
    ("measured", "fails"),
    [
        (CollectiveTiming(latency_s=0.004, busbw_gbps=0.3), False),  # 4x slower round trip, a third of the bandwidth
        (CollectiveTiming(latency_s=0.006, busbw_gbps=1.0), True),  # round trip 6x
        (CollectiveTiming(latency_s=0.001, busbw_gbps=0.15), True),  # bandwidth fell 6.7x
        (CollectiveTiming(latency_s=0.0005, busbw_gbps=4.0), False),  # faster than at pre-flight
    ],
)
def test_the_collective_fails_beyond_the_slowdown_in_round_trip_or_bandwidth(measured, fails):
    assert degradation(BASE, measured).exceeds(5.0) is fails


def test_the_pairs_hold_rank_0_with_every_rank_and_ranks_1_and_2():
    assert link_pairs(2) == [(0, 1)]
    assert link_pairs(4) == [(0, 1), (0, 2), (0, 3), (1, 2)]


def _times(world_size: int, slow: int | None, *, fast: float = 0.001, slowed: float = 0.05) -> dict:
    return {pair: (slowed if slow in pair else fast) for pair in link_pairs(world_size)}


@pytest.mark.parametrize(("world_size", "slow"), [(3, 0), (3, 1), (3, 2), (4, 3), (5, 0), (5, 2)])
def test_the_rank_whose_every_link_is_slow_is_the_one_named(world_size, slow):
    named, why = slow_ranks(_times(world_size, slow), world_size, 5.0)
    assert named == [slow], why
    assert "every link of this rank" in why


def test_two_ranks_and_a_slow_fabric_name_every_rank_and_say_why():
    assert slow_ranks(_times(2, 1), 2, 5.0) == ([0, 1], "two ranks cannot be told apart (round trip 0-1 50 ms)")
    named, why = slow_ranks(_times(4, None, fast=0.05), 4, 5.0)
    assert named == [0, 1, 2, 3] and why.startswith("no link stands out")
    # Only 0-1 is fast: ranks 2 and 3 have no fast link, so both are named.
    assert slow_ranks({**{p: 0.05 for p in link_pairs(4)}, (0, 1): 0.001}, 4, 5.0)[0] == [2, 3]


def test_one_process_checks_nvml_and_names_its_rank():
    nvml = FakeNVML(device_count=1)
    check = PeriodicHealthCheck(slowdown=5.0, nvml=nvml)
    assert check.run(0, 1, torch.device("cpu")) == []
    nvml.set(0, ecc_uncorrected=1.0, remapped_rows_pending=1.0)
    failures = check.run(0, 1, torch.device("cpu"))
    assert [(f.rank, f.check) for f in failures] == [(0, "gpu"), (0, "gpu")]
    assert "1 uncorrected ECC errors" in failures[0].detail and "row remap is pending" in failures[1].detail
    nvml.set(0, ecc_uncorrected=0.0, remapped_rows_pending=0.0)
    nvml.throttle(0, "SwPowerCap", "SwThermalSlowdown")  # normal under load
    assert check.run(0, 1, torch.device("cpu")) == []
    nvml.throttle(0, "HwPowerBrakeSlowdown")
    (failure,) = check.run(0, 1, torch.device("cpu"))
    assert "clocks held down by HwPowerBrakeSlowdown" in failure.detail


def _slow_sends_of_rank_1(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    check = PeriodicHealthCheck(slowdown=10.0)
    assert check.run(rank, world_size, torch.device("cpu")) == []
    baseline = check.baseline  # the first check measured it (no pre-flight here)
    assert baseline is not None and baseline.latency_s > 0 and baseline.busbw_gbps > 0
    patches = []
    if rank == 1:  # a slow link out of rank 1: every collective and send leaves 200 ms late

        def late(fn):
            def slowed(*args, **kwargs):
                time.sleep(0.2)
                return fn(*args, **kwargs)

            return slowed

        for name in ("all_reduce", "send", "all_gather_object"):
            patches.append(_compat.Patch(dist, name, late(getattr(dist, name)), name=f"test: slow {name}").install())
    try:
        failures = check.run(rank, world_size, torch.device("cpu"))
    finally:
        for patch in patches:
            patch.undo()
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, failures)
    assert all(f == everyone[0] for f in everyone)  # the same report on every rank
    assert [(f.rank, f.check) for f in failures] == [(1, "collective")], failures
    assert "every link of this rank is slower" in failures[0].detail
    assert check.last["slowdown"]["latency"] > 10.0 and check.last["baseline"] is not None


def test_a_slow_link_out_of_one_of_three_ranks_is_named_on_every_rank():
    run_distributed(_slow_sends_of_rank_1, 3)
