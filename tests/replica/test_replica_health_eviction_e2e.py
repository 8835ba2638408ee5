"""Eviction without a restart by a sick device: three replica groups under torchrun, the device of one group turns
sick mid-run, and its group leaves the quorum with its health record while the other two never restart and keep
committing steps; a relaunch of the evicted group on the same node is refused while the record's cooldown lasts.

- ``health_check``: the periodic health checks (``FaultPolicy(health_check_every_n_steps=5,
  health_check_action="evict")``) find 2 uncorrected ECC errors;
- ``thermal``: ``ThermalMonitor(action="evict", evict_after=2)`` reads a hardware thermal slowdown twice in a row;
- ``thermal_two_ranks``: as ``thermal``, with groups of two processes where only rank 1's device in group 2 is sick:
  the sick rank evicts its node, hence its whole group, and the other groups go on. (Every group has two processes:
  torchft joins rank ``r`` of each group with rank ``r`` of the others, so groups of different sizes do not form a
  quorum: a two-process group beside one-process groups never commits a step.)

A CPU has no NVML: the device is a ``FakeNVML`` given through the seams the non-replica eviction tests use
(``ThermalMonitor(nvml=...)``; the fault handler's ``nvml``, tests/fault/fault_script.py), made sick from a step on
(tests/replica/replica_script.py, ``--evict-on``). Everything after the reading is real: the check or monitor, the
record, the agent leaving, the quorum without the group, the relaunch refused.

While ``<tmp>/hold`` exists every step sleeps, so that the sick group is surely in the quorum before the end; once it
is gone the hold is lifted and the survivors finish at full speed. The groups' event logs are also what
tests/cli/test_job_report.py's e2e part reads (``lightning-ft report`` of the whole job).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ft.events import read_events
from lightning_ft.fault.health_record import NODE_UNAVAILABLE_EXIT_CODE, node_name, read_record
from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_groups_e2e import SCRIPT, _log, _records

pytest.importorskip("torchft")

MAX_STEPS = 160
SICK_FROM = 10


def start_group(
    tmp: Path, name: str, replica_id: str, address: str, kind: str, *, nproc: int = 1, sick_ranks: str = ""
) -> subprocess.Popen:
    """One replica group (a torchrun job of ``nproc`` processes) of tests/replica/replica_script.py with
    ``--evict-on kind``; the ranks of ``sick_ranks`` (a comma list, empty: none) turn sick at step ``SICK_FROM``."""
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="3")
    env["REPLICA_TEST_SICK_RANKS"] = sick_ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--max-steps", str(MAX_STEPS)]
    cmd += ["--evict-on", kind, "--sick-from", str(SICK_FROM), "--step-sleep", "0.2"]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    # Its own session: a test that gives up kills the agent and its workers together (killpg), leaving no orphan.
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_job(tmp: Path, kind: str, *, group_size: int = 1) -> tuple[float, int, int]:
    """Three groups of ``group_size`` processes, the last rank of g2 sick; g2 relaunched after the survivors finished.
    Returns (the time g2 left, its exit code, the relaunch's exit code)."""
    hold = tmp / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    sick = str(group_size - 1)
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(3):
                procs[f"g{i}"] = start_group(
                    tmp, f"g{i}", str(i), address, kind, nproc=group_size, sick_ranks=sick if i == 2 else ""
                )
            try:
                code = procs["g2"].wait(timeout=600)
            except subprocess.TimeoutExpired:
                pytest.fail("the sick group was not evicted:\n" + "\n".join(_log(tmp, n) for n in procs))
            left_at = time.time()
            hold.unlink()
            for name in ("g0", "g1"):
                assert procs[name].wait(timeout=600) == 0, _log(tmp, name)
            # A relaunch of the evicted group on the same node is refused while its record's cooldown lasts.
            procs["g2b"] = start_group(tmp, "g2", "2", address, kind, nproc=group_size)
            relaunch = procs["g2b"].wait(timeout=300)
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the workers too, whether the agent is still there or not
            proc.wait()
    return left_at, code, relaunch


def assert_evicted_without_a_restart(tmp: Path, source: str, left_at: float, code: int, relaunch: int) -> dict:
    """The sick group left with its record and code 69, the survivors never restarted and committed every step to the
    end, one ``replica_lost`` each; the relaunch was refused. Returns what was measured."""
    assert code != 0, _log(tmp, "g2")  # its agent left on a signal (torchrun exits 1)
    record = read_record(tmp / "g2" / "checkpoints", node_name())
    assert record is not None and not record.healthy and record.source == source, record
    assert record.until > left_at, record  # the cooldown is still on
    events = read_events(tmp / "g2")
    evicted = [e for e in events if e["event"] == "node_evicted"]
    assert len(evicted) == 1, evicted
    assert evicted[0]["replica_id"] == "2" and evicted[0]["source"] == source, evicted
    assert evicted[0]["checkpoint_path"] is None  # no checkpoint: the live groups hold the state
    assert evicted[0]["step"] >= SICK_FROM, evicted
    ends = [e for e in events if e["event"] == "attempt_end" and e["attempt"] == evicted[0]["attempt"]]
    assert ends and {e.get("exit_code") for e in ends} == {NODE_UNAVAILABLE_EXIT_CODE}, ends  # every rank of it
    assert relaunch != 0 and any(e["event"] == "join_refused" for e in read_events(tmp / "g2")), _log(tmp, "g2")
    last_sick_step = max(r["step"] for r in _records(tmp, "g2") if r["time"] <= left_at)

    stalls = []
    for name in ("g0", "g1"):
        runs = _records(tmp, name)
        assert len({r["pid"] for r in runs}) == 1, f"{name} restarted"
        steps = [r["step"] for r in runs]
        assert steps == list(range(steps[0], MAX_STEPS + 1)), steps  # a group that joined late healed first
        assert any(r["step"] > last_sick_step + 5 for r in runs)
        their_events = read_events(tmp / name)
        lost = [e for e in their_events if e["event"] == "replica_lost"]
        assert [e["replica_id"] for e in lost] == ["2"], lost
        stalls.append(round(lost[0]["stall_s"], 3))
        assert not any(e["event"] in ("node_evicted", "health_check_failed") for e in their_events)
        assert json.loads((tmp / name / "done.json").read_text())["global_step"] == MAX_STEPS
    return {"evicted_step": evicted[0]["step"], "last_sick_step": last_sick_step, "stalls_s": stalls}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("kind", "group_size"),
    [
        ("health_check", 1),
        # the thermal path at one rank is the two-rank case's, less the group's second rank: the longer tier
        pytest.param("thermal", 1, marks=pytest.mark.extended),
        ("thermal_two_ranks", 2),
    ],
)
def test_a_sick_device_evicts_its_group_and_the_others_keep_stepping_without_a_restart(
    tmp_path: Path, kind: str, group_size: int
) -> None:
    source = "health_check" if kind == "health_check" else "thermal"
    left_at, code, relaunch = run_job(tmp_path, source, group_size=group_size)
    measured = assert_evicted_without_a_restart(tmp_path, source, left_at, code, relaunch)
    events = read_events(tmp_path / "g2")
    if source == "health_check":
        (failed,) = [e for e in events if e["event"] == "health_check_failed"]
        assert failed["periodic"] and failed["action"] == "evict" and failed["ranks"] == [0], failed
        assert "2 uncorrected ECC errors" in failed["checks"][0]["detail"], failed
        # The record and the event say what happens in this mode: no checkpoint, the group leaves the quorum.
        reason = next(e for e in events if e["event"] == "node_evicted")["reason"]
        assert "its replica group leaves the quorum" in reason and "preempt-step" not in reason, reason
    else:
        named = [e for e in events if e["event"] == "thermal" and e["throttled"]]
        assert named and {e["rank"] for e in named} == {group_size - 1}, named  # the sick rank only
        assert "HwThermalSlowdown" in named[0]["reasons"], named
        evicted = next(e for e in events if e["event"] == "node_evicted")
        assert evicted["ranks"] == list(range(group_size)), evicted  # its node leaves: the whole group
    job = assert_job_report(tmp_path, source)
    print(
        f"\nreplica eviction by {kind}: {measured}; the job's report: ETTR {job['ettr']:.3f}, wall {job['wall_s']:.1f} s"
    )


def assert_job_report(tmp: Path, source: str) -> dict:
    """``lightning-ft report <tmp>`` (the folder of the three groups' folders) reports the job: the eviction once,
    with the survivors' longest stall, the live groups 3 -> 2, every committed step once, each group's attempts."""
    cmd = [sys.executable, "-m", "lightning_ft.cli", "report", str(tmp), "--json"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    (failure,) = job["failures"]
    assert failure["replica_id"] == "2" and failure["how"] == "evicted", failure
    assert failure["detail"].startswith(f"{source}: "), failure
    survivors = {name[1]: read_events(tmp / name) for name in ("g0", "g1")}
    lost = {g: next(e for e in evs if e["event"] == "replica_lost") for g, evs in survivors.items()}
    assert failure["stall_by_group"] == {g: e["stall_s"] for g, e in lost.items()}, failure
    assert failure["stall_s"] == max(e["stall_s"] for e in lost.values()) == job["stall_s"]
    assert failure["discarded_steps"] == max(e["discarded_steps"] for e in lost.values()) == job["discarded_steps"]
    live = [c["live_groups"] for c in job["live_groups"]]
    assert max(live) == 3 and live[-1] == 2, job["live_groups"]
    assert job["committed_steps"] == MAX_STEPS, job  # steps 1..MAX_STEPS, each once, whichever groups trained them
    assert 0 < job["ettr"] < 1, job
    groups = {g["replica_id"]: g for g in job["groups"]}
    assert sorted(groups) == ["0", "1", "2"], groups
    assert [a["ended"] for a in groups["2"]["attempts"]] == [
        f"evicted ({source})",
        "refused to join (its node's cooldown)",
    ]
    assert all([a["ended"] for a in groups[g]["attempts"]] == ["finished"] for g in ("0", "1")), groups
    healed = {h["replica_id"] for h in job["heals"]}
    assert healed == {
        e["replica_id"] for g in ("g0", "g1", "g2") for e in read_events(tmp / g) if e["event"] == "healed"
    }
    return job
