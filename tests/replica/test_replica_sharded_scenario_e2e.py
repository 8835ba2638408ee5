"""The held-out scenario with sharded groups: two groups of two processes under torchrun on CPU gloo, each sharding
the model inside (FSDP2 over its data-parallel axis, or Lightning's tensor-parallel example with
``tensor_parallel_size=2``), and in one run, one fault at a time:

1. the lighthouse is SIGKILLed and started again at its address 1 s later (both groups live);
2. group 1 is lost as a group (both workers SIGKILLed mid-step, then its torchrun agent) and relaunched (``g1b``);
3. the relaunched group hangs inside a step on both ranks past ``timeout`` (its heartbeats go on), is SIGKILLed later
   as a supervisor would, and is relaunched again (``g1c``).

Group 0 lives through all three. The fit has something to learn (tests/replica/sharded_script.py ``--learnable``), a
validation set every group validates whole at each epoch's end, a ``ReduceLROnPlateau(monitor="val_loss")`` beside a
``StepLR``, and an ``EarlyStopping(monitor="val_loss")`` that ends it after the faults (:data:`FIT`). While
``<tmp>/hold`` exists each step sleeps (the faults land mid-step and the fit outlasts them); the hold is lifted once the
last relaunched group commits.

What is compared (every rank records its own shards at every committed step):

- every group against every other, bitwise, at every committed step both took part in and at the end: each rank's
  shards of the weights and the optimizer state, both LR schedulers, the learning rate, the RNG, the loop counters and
  the accumulation (invariant 6); every validation gave every group the same ``val_loss``, bitwise; every group
  stopped at the same step with the same learning rate;
- against the same two groups run without a failure (``keep_global``: every committed step trains the same global
  batch): each committed step trained exactly the sample ids of that run's step, each once; the validations ran at the
  same steps with ``val_loss`` within :data:`RTOL`, so the same decisions (the same final learning rate, bitwise, and
  the same stop); the final weights agree to ``rtol=1e-9``. Not bitwise: while one group is alone it sums two
  micro-batches where two groups averaged one each, which differs by the rounding of that order (float64: ~1e-16 per
  step, tests/replica/test_replica_sharded_e2e.py), while a lost or repeated batch moves the weights by ~1e-3.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.replica._lighthouse import Lighthouse
from tests.replica.test_replica_scenario_e2e import _kill_if_running
from tests.replica.test_replica_sharded_e2e import BATCH, data_ranks, log_tail, records, start_group, wait_for

pytest.importorskip("torchft")

SAMPLES = 512
"""An epoch: 32 steps of 2 groups x 2 data-parallel ranks x 4 under FSDP2 (64 steps of 2 x 4 under tensor parallel)."""
FIT = ("--learnable", "--samples", str(SAMPLES), "--val-samples", "64", "--plateau", "--early-stop", "1e-4")
FIT += ("--max-epochs", "30")
"""The fit: early stopped on ``val_loss``, well after the faults (the numbers are printed with ``-s``)."""
STATE = ("weights", "optimizer", "scheduler", "plateau", "lr", "rng", "loop", "accumulate")
RTOL, ATOL = 1e-9, 1e-12
OUTAGE_S = 1.0
LIGHTHOUSE = ("--join-timeout-s", "3")
"""A join timeout of 3 s: on a loaded machine a group a little late for a quorum still makes it."""
RANKS = (0, 1)
HANG_S = 8.0
"""How long the hung group hangs before a supervisor SIGKILLs it. Past the groups' ``timeout`` (3 s), within the
quorum timeout (36 s). With two groups the survivor cannot go on before the kill: torchft's lighthouse forms a quorum
only from more than half of the groups that heartbeat (against a split brain), and a hung group's heartbeats go on;
the survivor waits, and stops with "no quorum ... formed" after the quorum timeout if nothing kills the hung group.
With three or more groups the others go on after ``timeout`` (tests/replica/test_replica_scenario_e2e.py)."""


def _validations(tmp: Path, name: str) -> dict[int, float]:
    path = tmp / name / "val.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: float.fromhex(r["val_loss"]) for r in map(json.loads, lines)}


def _kill_group(proc: subprocess.Popen, workers: list[int]) -> None:
    """SIGKILL every worker of the group (mid-step), then its torchrun agent: the whole group is gone."""
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=60)


def _run(tmp: Path, model: str, *, faults: bool) -> dict[str, Any]:
    """Two groups sharing their first quorum (a start gate); ``faults``: the scenario of the module docstring.
    Returns the records by group and rank, the outages and the steps of the faults."""
    tmp.mkdir(parents=True, exist_ok=True)
    hold, gate = tmp / "hold", tmp / "go"
    if faults:
        hold.write_text("0.3")
    procs: dict[str, subprocess.Popen] = {}
    live: dict[str, subprocess.Popen] = {}
    found: dict[str, Any] = {"outages": [], "faults": {}}
    house = Lighthouse(tmp, min_replicas=1, options=LIGHTHOUSE)

    def launch(name: str, *more: str) -> None:
        procs[name] = live[name] = start_group(
            tmp, name, "0" if name == "g0" else "1", house.address, model, *FIT, *more
        )

    def step(name: str) -> int:
        return min((records(tmp, name, r) or [{"step": 0}])[-1]["step"] for r in RANKS)

    def wait(condition, what: str, timeout_s: float = 300) -> None:
        wait_for(condition, what, timeout_s, live, tmp)

    def went_on(name: str, since: int, steps: int = 3) -> None:
        wait(lambda: step(name) >= since + steps, f"{name} to go on")

    def healed_and_committed(name: str) -> None:
        wait(lambda: all(len(records(tmp, name, r)) >= 2 for r in RANKS), f"{name} to heal and commit")

    try:
        for name in ("g0", "g1"):
            launch(name, "--start-gate", str(gate))
        ready = [tmp / n / f"ready{r}" for n in ("g0", "g1") for r in RANKS]
        wait(lambda: all(p.exists() for p in ready), "both groups to start")
        gate.touch()
        if not faults:
            for name in ("g0", "g1"):
                procs[name].wait(timeout=900)
                assert procs[name].returncode == 0, log_tail(tmp, name)
            return {"runs": {n: {r: records(tmp, n, r) for r in RANKS} for n in ("g0", "g1")}, **found}
        wait(lambda: step("g0") >= 4 and step("g1") >= 4, "both groups to commit steps together")

        # 1. The lighthouse is SIGKILLed and started again at its address 1 s later.
        killed = house.kill()
        time.sleep(OUTAGE_S)
        up = house.start()
        wait(
            lambda: all(sum(x["time"] > up for x in records(tmp, n, 0)) >= 3 for n in ("g0", "g1")),
            "steps after the lighthouse is back",
        )
        found["outages"].append({"killed": killed, "up": up, "step": step("g0")})

        # 2. Group 1 is lost as a group mid-step, and relaunched.
        found["until"] = time.time()
        found["faults"]["sigkill"] = step("g0")
        _kill_group(live.pop("g1"), [records(tmp, "g1", r)[-1]["pid"] for r in RANKS])
        went_on("g0", found["faults"]["sigkill"])
        launch("g1b")
        healed_and_committed("g1b")

        # 3. The relaunched group hangs inside a step on both ranks; a supervisor SIGKILLs it HANG_S later, and
        # relaunches it. Group 0 waits for the kill: with two groups the lighthouse forms no quorum while the hung one
        # heartbeats (see HANG_S).
        workers = [records(tmp, "g1b", r)[-1]["pid"] for r in RANKS]
        (tmp / "g1b" / "hang").touch()
        found["faults"]["hang"] = step("g0")
        hung = live.pop("g1b")
        time.sleep(HANG_S)
        found["hang_killed"] = time.time()
        _kill_group(hung, workers)
        went_on("g0", found["faults"]["hang"])
        launch("g1c")
        healed_and_committed("g1c")
        found["released"] = step("g0")
        hold.unlink()
        for name in ("g0", "g1c"):
            try:
                procs[name].wait(timeout=900)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish:\n{log_tail(tmp, name)}")
            assert procs[name].returncode == 0, log_tail(tmp, name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for name in procs:  # workers whose agent was killed first
            for rank in RANKS:
                for pid in {x["pid"] for x in records(tmp, name, rank)}:
                    _kill_if_running(pid, str(tmp / name))
        house.stop()
    found["runs"] = {n: {r: records(tmp, n, r) for r in RANKS} for n in ("g0", "g1", "g1b", "g1c")}
    return found


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("model", ["fsdp2", "tp"], ids=["fsdp2", "tensor-parallel"])
def test_sharded_groups_stay_one_model_through_a_lighthouse_outage_a_lost_group_and_a_hung_group(
    tmp_path: Path, model: str
) -> None:
    import torch

    started = time.monotonic()
    reference = _run(tmp_path / "reference", model, faults=False)
    reference_s = time.monotonic() - started
    started = time.monotonic()
    scenario = _run(tmp_path / "fault", model, faults=True)
    fault_s = time.monotonic() - started
    fault, ref_dir = tmp_path / "fault", tmp_path / "reference"
    runs, names = scenario["runs"], ("g0", "g1", "g1b", "g1c")
    ref_done = json.loads((ref_dir / "g0" / "done.json").read_text())
    per_epoch = SAMPLES // (2 * len(data_ranks(model)) * BATCH)
    assert ref_done["global_step"] % per_epoch == 0 and ref_done["global_step"] < 30 * per_epoch, ref_done

    # Group 0 never restarted; every group counts its committed steps one by one, one optimizer step each, except
    # across a heal (a group that missed a quorum heals at the next step without a restart).
    events = {name: read_events(fault / name) for name in names}
    for name, by_rank in runs.items():
        healed_at = {e["step"] for e in events[name] if e["event"] == "healed"}
        for rank, rs in by_rank.items():
            steps = [r["step"] for r in rs]
            gaps = [(a, b) for a, b in zip(steps, steps[1:], strict=False) if b != a + 1]
            assert all(a < b and b - 1 in healed_at for a, b in gaps), (name, rank, steps, healed_at)
            assert all(r["adam_steps"] == r["step"] for r in rs), (name, rank)
    assert all(len({r["pid"] for r in runs["g0"][rank]}) == 1 for rank in RANKS), "group 0 restarted"
    assert [e["reason"] for e in events["g0"] if e["event"] == "attempt_end"] == ["finished"] * len(RANKS)

    # Every group is every other, bitwise, at every shared committed step (rank r's shards against rank r's), and at
    # the end (group 0 included: it may miss the restarted lighthouse's first quorum and heal from group 1); each
    # relaunched group healed once, from group 0, at its first step.
    for rank in RANKS:
        by_step: dict[int, dict[str, Any]] = {}
        for name in names:
            for r in runs[name][rank]:
                first = by_step.setdefault(r["step"], r)
                assert {k: r[k] for k in STATE} == {k: first[k] for k in STATE}, (name, rank, r["step"])
        ends = [torch.load(fault / name / f"final{rank}.pt") for name in ("g0", "g1c")]
        assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0]), rank
    heals = {}
    for name in ("g1b", "g1c"):
        healed = [e for e in events[name] if e["event"] == "healed"]
        assert len(healed) == 1 and healed[0]["source"] == "0" and healed[0]["bytes"] > 0, healed
        assert healed[0]["step"] + 1 == runs[name][0][0]["step"], (name, healed)
        heals[name] = (healed[0]["step"], healed[0]["bytes"], round(healed[0]["seconds"], 3))

    # One stop, agreed: the same step, the same learning rate, the same validations, bitwise; after every fault.
    done = {name: json.loads((fault / name / "done.json").read_text()) for name in ("g0", "g1c")}
    assert len({(d["global_step"], d["lr"]) for d in done.values()}) == 1, done
    end = done["g0"]["global_step"]
    assert scenario["released"] < end, (scenario["released"], end)
    validations = {name: _validations(fault, name) for name in names}
    for name, values in validations.items():
        for s, loss in values.items():
            assert all(other.get(s, loss) == loss for other in validations.values()), (name, s)

    # The lighthouse outage cost each group its downtime: at most one lighthouse_outage each (a group whose quorum
    # requests fell between the kill and the restart records none). A restarted lighthouse knows no group, and with
    # min_replicas=1 the first group to ask makes its first quorum alone: the other misses that quorum and heals at
    # the next step, without a restart (allowed, printed; the bitwise and sample checks cover it). Nothing else.
    outage = scenario["outages"][0]
    outage_stalls, missed = [], []
    for name in ("g0", "g1"):
        seen = [e for e in events[name] if outage["killed"] <= e["time"] <= scenario["until"]]
        recorded = [round(e["stall_s"], 2) for e in seen if e["event"] == "lighthouse_outage"]
        assert len(recorded) <= 1, (name, recorded)
        healed_at = [e["step"] for e in seen if e["event"] == "healed"]
        assert len(healed_at) <= 1, (name, healed_at)
        missed += [(name, step) for step in healed_at]
        outage_stalls.append((name, round(outage["up"] - outage["killed"], 2), recorded))
    for name in ("g0", "g1"):
        seen = [e for e in events[name] if outage["killed"] <= e["time"] <= scenario["until"]]
        lost = {e["replica_id"] for e in seen if e["event"] == "replica_lost"}
        assert lost <= {"0" if n == "g0" else "1" for n, _ in missed}, (name, lost, missed)

    # Against the run without a failure: each committed step trained that run's samples (each once; the steps a group
    # died in may be committed without its record), the same validations within RTOL, the same decisions, and the
    # final weights within rtol=1e-9.
    ref_runs = reference["runs"]
    ref_trained: dict[int, list[int]] = {}
    trained: dict[int, list[int]] = {}
    for target, source in ((ref_trained, ref_runs), (trained, runs)):
        for by_rank in source.values():
            for rank in data_ranks(model):
                for r in by_rank[rank]:
                    target.setdefault(r["step"], []).extend(r["step_samples"])
    assert sorted(trained) == sorted(ref_trained) == list(range(1, end + 1))
    died_in = {last[0][-1]["step"] + 1 for last in (runs["g1"], runs["g1b"])}
    for s, samples in trained.items():
        assert len(set(samples)) == len(samples), s
        if s in died_in:
            assert set(samples) <= set(ref_trained[s]), s
        else:
            assert sorted(samples) == sorted(ref_trained[s]), s
    ref_validations = _validations(ref_dir, "g0")
    assert sorted(ref_validations) == sorted(validations["g0"]), (ref_validations, validations["g0"])
    for s, loss in validations["g0"].items():
        assert abs(loss - ref_validations[s]) <= RTOL * abs(ref_validations[s]), (s, loss, ref_validations[s])
    assert (ref_done["global_step"], ref_done["lr"]) == (end, done["g0"]["lr"]), (ref_done, done["g0"])
    worst = 0.0
    for rank in RANKS:
        got = torch.load(fault / "g0" / f"final{rank}.pt")
        want = torch.load(ref_dir / "g0" / f"final{rank}.pt")
        for key, value in want.items():
            if not value.is_floating_point():
                assert torch.equal(got[key], value), key
                continue
            assert torch.allclose(got[key], value, rtol=RTOL, atol=ATOL), (key, (got[key] - value).abs().max())
            worst = max(worst, float(((got[key] - value).abs() / value.abs().clamp_min(1e-3)).max()))

    lost = [(e["step"], round(e["stall_s"], 2)) for e in events["g0"] if e["event"] == "replica_lost"]
    before_hang = max(r["time"] for r in runs["g0"][0] if r["time"] < scenario["hang_killed"])
    after_kill = min(r["time"] for r in runs["g0"][0] if r["time"] > scenario["hang_killed"])
    hang_stall = (round(after_kill - before_hang, 2), round(after_kill - scenario["hang_killed"], 2))
    lrs = sorted({r["lr"] for r in runs["g0"][0]}, reverse=True)
    print(
        f"\nsharded scenario ({model}): outage (group, down s, stall_s) {outage_stalls}; a group missing the"
        f" restarted lighthouse's first quorum (group, step healed) {missed}; faults at steps"
        f" {scenario['faults']}; group 0's replica_lost (step, stall_s) {lost}; hang: group 0's gap between commits"
        f" and the kill to its next commit {hang_stall} s (hung {HANG_S} s); heals (step, bytes, s) {heals};"
        f" validations {sorted(ref_validations)}; stopped at {end} of {30 * per_epoch}, lr {lrs[0]:.3g} ->"
        f" {done['g0']['lr']:.3g}; largest relative difference to the run without a failure {worst:.1e}; fault run"
        f" {fault_s:.0f} s, reference {reference_s:.0f} s"
    )
