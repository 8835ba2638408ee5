"""Three replica groups under torchrun, a plain LightningModule: one group is SIGKILLed mid-step, the others never
restart and keep stepping, and a replacement started later heals from a live group, bitwise equal to the survivors at
its first committed step (weights, optimizer, LR scheduler, RNG, a stateful callback, the loop counters).

The run: tests/replica/replica_script.py. While ``<tmp>/hold`` exists every step sleeps 0.2 s, so that the groups
overlap in time and the kill lands mid-step; once the replacement has committed steps the hold is lifted and the run
finishes at full speed. Times are measured and printed (``-s``), never asserted.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")

SCRIPT = Path(__file__).with_name("replica_script.py")
MAX_STEPS = 600
STATE = ("weights", "optimizer", "scheduler", "lr", "rng", "callback", "loop")  # compared bitwise across groups


def _start(
    tmp: Path, name: str, replica_id: str, address: str, *, policy: str = "keep_local_none", args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """One group of three (``NUM_REPLICA_GROUPS=3``). ``policy``: replica_script.py's ``--policy``; the default keeps
    the per-group batch and the learning rate at a membership change (three groups of accumulation 1 cannot keep the
    global batch at two); ``args``: more of the script's arguments (the last ``--max-steps`` wins)."""
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="3")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--max-steps", str(MAX_STEPS)]
    cmd += ["--policy", policy, *args]
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _records(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / name / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(condition, what: str, timeout_s: float, procs: dict[str, subprocess.Popen], tmp: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for name, proc in procs.items():
            if proc.poll() not in (None, 0) and name != "g2":
                pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}:\n{_log(tmp, name)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(_log(tmp, n) for n in procs))
        time.sleep(0.2)


def _log(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.log"
    lines = [ln for ln in (path.read_text() if path.exists() else "").splitlines() if "Quorum status" not in ln]
    return f"--- {name}\n" + "\n".join(lines[-40:])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["sigkill", "hang"])
def test_survivors_keep_stepping_through_a_lost_group_and_the_replacement_heals_bitwise(
    tmp_path: Path, fault: str
) -> None:
    """``sigkill``: the group's worker is SIGKILLed mid-step (a lost node). ``hang``: its training thread stops
    mid-step while torchft's heartbeat thread goes on (a hung rank), and it is SIGKILLed later, as a supervisor
    would, before the replacement starts."""
    hold = tmp_path / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(3):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address)
            # All three in the quorum: the last group to join has committed a few steps.
            _wait(
                lambda: all(len(_records(tmp_path, f"g{i}")) >= 5 for i in range(3)), "3 groups", 300, procs, tmp_path
            )

            victim = _records(tmp_path, "g2")[-1]["pid"]
            if fault == "hang":
                (tmp_path / "g2" / "hang").touch()
            else:
                os.kill(victim, signal.SIGKILL)  # the group's only worker, mid-step (steps sleep while held) ...
                procs["g2"].kill()  # ... and its torchrun agent: the whole group is gone, as with a lost node
                procs["g2"].wait(timeout=60)
            killed_at = time.time()
            step_at_kill = _records(tmp_path, "g0")[-1]["step"]

            _wait(
                lambda: all(_records(tmp_path, f"g{i}")[-1]["step"] >= step_at_kill + 5 for i in range(2)),
                "the survivors to go on",
                120,
                procs,
                tmp_path,
            )
            if fault == "hang":  # the hung group is ended (its watchdog or a supervisor would) and replaced
                os.kill(victim, signal.SIGKILL)
                procs["g2"].kill()
                procs["g2"].wait(timeout=60)
            replacement_launched = time.time()
            procs["g2b"] = _start(tmp_path, "g2b", "2", address)  # the replacement takes the lost group's id
            _wait(lambda: len(_records(tmp_path, "g2b")) >= 3, "the replacement to commit steps", 300, procs, tmp_path)
            hold.unlink()
            for name in ("g0", "g1", "g2b"):
                try:
                    procs[name].wait(timeout=300)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{name} did not finish:\n{_log(tmp_path, name)}")
                assert procs[name].returncode == 0, _log(tmp_path, name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    runs = {name: _records(tmp_path, name) for name in ("g0", "g1", "g2b")}
    by_step = {name: {r["step"]: r for r in records} for name, records in runs.items()}

    # Survivors never restarted, and went on while the lost group was gone and its replacement was starting.
    replacement_start = runs["g2b"][0]["time"]
    for name in ("g0", "g1"):
        assert len({r["pid"] for r in runs[name]}) == 1, f"{name} restarted"
        during = [r for r in runs[name] if killed_at < r["time"] < replacement_start]
        assert len(during) >= 5, f"{name} committed {len(during)} steps while a group was missing"

    # A discarded step is not applied and not counted: every committed step is one optimizer step and one scheduler
    # step, and steps are counted one by one in every group, including the healed one.
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        assert steps == list(range(steps[0], steps[0] + len(steps))), f"{name}: steps {steps}"
        for r in records:
            assert r["adam_steps"] == r["step"] == r["scheduler_steps"], (name, r)
            assert r["loop"][0] == r["step"]

    # The replacement, at its first committed step, is bitwise the survivors.
    first = runs["g2b"][0]
    for survivor in ("g0", "g1"):
        theirs = by_step[survivor][first["step"]]
        assert {k: first[k] for k in STATE} == {k: theirs[k] for k in STATE}, (first, theirs)
    _assert_committed_history_trains_each_sample_once(tmp_path, runs)
    # ... and stays so to the end; every group ends at the same global step.
    for step, record in by_step["g2b"].items():
        assert {k: record[k] for k in STATE} == {k: by_step["g0"][step][k] for k in STATE}, step
    done = {name: json.loads((tmp_path / name / "done.json").read_text()) for name in runs}
    assert {d["global_step"] for d in done.values()} == {MAX_STEPS}

    # What the event logs say: the loss (with the stall it cost), the join and the heal.
    lost = [e for n in ("g0", "g1") for e in read_events(tmp_path / n) if e["event"] == "replica_lost"]
    joined = [e for n in ("g0", "g1") for e in read_events(tmp_path / n) if e["event"] == "replica_joined"]
    healed = [e for e in read_events(tmp_path / "g2b") if e["event"] == "healed"]
    assert {e["replica_id"] for e in lost} == {"2"} and len(lost) == 2, lost
    assert all(e["stall_s"] >= 0 and e["discarded_steps"] >= 0 for e in lost), lost
    assert any(e["replica_id"] == "2" and e["step"] > step_at_kill for e in joined), joined
    assert len(healed) == 1 and healed[0]["source"] in {"0", "1"} and healed[0]["bytes"] > 0, healed
    assert healed[0]["step"] + 1 == first["step"]
    # The loggers show the live groups per step: 3, then 2 while the group was missing, then 3 again.
    with open(tmp_path / "g0" / "csv" / "version_0" / "metrics.csv") as f:
        logged = [float(row["replica/live_groups"]) for row in csv.DictReader(f) if row.get("replica/live_groups")]
    assert 2.0 in logged and logged[-1] == 3.0 and max(logged) == 3.0, logged
    print(
        "\nreplica groups: stall per failure",
        [round(e["stall_s"], 3) for e in lost],
        "s; discarded steps",
        [e["discarded_steps"] for e in lost],
        f"; heal {healed[0]['bytes']} bytes in {healed[0]['seconds']:.3f} s;",
        f"replacement: launch to first committed step {first['time'] - replacement_launched:.1f} s",
    )


def _assert_committed_history_trains_each_sample_once(tmp: Path, runs: dict[str, list[dict[str, Any]]]) -> None:
    """The committed history of the epoch, over every group (the lost one's steps before the kill included), trains
    each sample exactly once, and in the epoch's order: the samples of committed steps are a prefix of the sampler's
    stream with nothing repeated and nothing skipped, although a group died mid-epoch, its part was dealt to the
    survivors and a replacement joined (and a discarded step's batches were trained again). With torchft's fixed part
    per group, the lost group's part stops where it died while the others read on: the history has a hole."""
    import torch

    records = [r for r in _records(tmp, "g2") + [r for rs in runs.values() for r in rs] if r["loop"][2] == 0]
    trained = [i for r in records for i in r["samples"]]
    repeated = sorted(i for i, n in Counter(trained).items() if n > 1)
    assert not repeated, f"{len(repeated)} samples trained twice in committed steps: {repeated[:20]}"
    # ResumableSampler's order of epoch 0 (the DistributedSampler Lightning injects has seed 0 here).
    order = torch.randperm(20000, generator=torch.Generator().manual_seed(0)).tolist()
    holes = sorted(order.index(i) for i in set(order[: len(trained)]) - set(trained))
    assert not holes, f"{len(holes)} stream positions before {len(trained)} never trained: {holes[:20]}"
    # Each deal is said in the event log, from the committed count every group agrees on.
    deals = [e for n in ("g0", "g1", "g2b") for e in read_events(tmp / n) if e["event"] == "replica_data"]
    assert {e["live_groups"] for e in deals} >= {2, 3}, deals
    assert all(e["committed"] % 8 == 0 and e["skipped"] == [] for e in deals), deals


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_group_stops_when_fewer_than_min_replicas_stay_live(tmp_path: Path) -> None:
    """One group alone with ``min_replicas=2``: every step is discarded, and after the quorum timeout (12 x 1 s) the
    group stops with an error naming ``min_replicas``, having committed nothing."""
    with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID="0")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
        cmd += [str(SCRIPT), "--out", str(tmp_path / "g0"), "--min-replicas", "2", "--timeout-s", "1"]
        cmd += ["--policy", "keep_local_none"]  # no NUM_REPLICA_GROUPS: a policy that scales would need it
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode != 0
    assert (
        "ReplicaGroups(min_replicas=2): only 1 replica group(s) live and no step committed" in proc.stdout + proc.stderr
    )
    assert _records(tmp_path, "g0") == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_groups_without_a_failure_train_bitwise_what_ddp_trains_on_two_processes(tmp_path: Path) -> None:
    """Invariant 3 with the mode on: two one-process groups (each reading its half of the data) end with the weights
    of one ``DDPStrategy`` job of two processes, bitwise (the average over two is exact in either order)."""
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    ddp += [str(SCRIPT), "--out", str(tmp_path / "ddp"), "--strategy", "ddp", "--max-steps", "40"]
    done = subprocess.run(ddp, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    procs: dict[str, subprocess.Popen] = {}
    with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        for i in range(2):
            env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS="2")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
            cmd += [str(SCRIPT), "--out", str(tmp_path / f"g{i}"), "--max-steps", "40"]
            log = open(tmp_path / f"g{i}.log", "w")  # noqa: SIM115 - closed with the process
            procs[f"g{i}"] = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        for name, proc in procs.items():
            assert proc.wait(timeout=500) == 0, _log(tmp_path, name)
    import torch

    expected = torch.load(tmp_path / "ddp" / "final0.pt")
    for name in procs:
        got = torch.load(tmp_path / name / "final0.pt")
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), name
    assert [r["step"] for r in _records(tmp_path, "g0")] == list(range(1, 41))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_groups_of_two_processes_average_inside_then_across_and_heal_rank_by_rank(tmp_path: Path) -> None:
    """Two groups of two processes each, the second started late: it heals rank by rank (rank r from rank r), is
    bitwise the first group at its first committed step, and every rank of both groups ends with the same weights at
    the same global step."""
    import torch

    hold = tmp_path / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        for i in range(2):
            env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(i), NUM_REPLICA_GROUPS="2")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
            cmd += [str(SCRIPT), "--out", str(tmp_path / f"g{i}"), "--max-steps", "300"]
            log = open(tmp_path / f"g{i}.log", "w")  # noqa: SIM115 - closed with the process
            procs[f"g{i}"] = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            if i == 0:
                _wait(lambda: len(_records(tmp_path, "g0")) >= 3, "the first group to step", 300, procs, tmp_path)
        _wait(lambda: len(_records(tmp_path, "g1")) >= 3, "the second group to heal and step", 300, procs, tmp_path)
        hold.unlink()
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, _log(tmp_path, name)
    finals = [torch.load(tmp_path / name / f"final{rank}.pt") for name in procs for rank in range(2)]
    assert all(f.keys() == finals[0].keys() and all(torch.equal(f[k], finals[0][k]) for k in f) for f in finals)
    first = _records(tmp_path, "g1")[0]
    theirs = {r["step"]: r for r in _records(tmp_path, "g0")}[first["step"]]
    assert first["step"] > 1 and {k: first[k] for k in STATE} == {k: theirs[k] for k in STATE}
    healed = [e for e in read_events(tmp_path / "g1") if e["event"] == "healed"]
    assert [e["rank"] for e in healed] == [0], healed  # the group's rank 0 writes it
