"""Eviction without a restart: three one-process replica groups under torchrun, one made slow (every step sleeps);
``StragglerMonitor(action="evict")`` compares the groups' own step times across groups, names the slow one, and it
leaves the quorum with its health record, while the other two never restart and keep committing steps. A relaunch of
the evicted group on the same node is refused while the record's cooldown lasts.

The run: tests/replica/replica_script.py (``--evict-stragglers``; ``REPLICA_TEST_SLOW_STEP_S`` slows group 2).
"""

from __future__ import annotations

import json
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

MAX_STEPS = 200
SLOW_STEP_S = 0.15


def _start(tmp: Path, name: str, replica_id: str, address: str, *, slow: bool = False) -> subprocess.Popen:
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="3")
    if slow:
        env["REPLICA_TEST_SLOW_STEP_S"] = str(SLOW_STEP_S)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--max-steps", str(MAX_STEPS)]
    cmd += ["--evict-stragglers", "--policy", "keep_local_none"]  # 3 groups of accumulation 1: no keep_global
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_straggler_group_is_evicted_and_the_others_keep_stepping_without_a_restart(tmp_path: Path) -> None:
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(3):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address, slow=i == 2)
            try:
                code = procs["g2"].wait(timeout=600)
            except subprocess.TimeoutExpired:
                pytest.fail("the slow group was not evicted:\n" + "\n".join(_log(tmp_path, n) for n in procs))
            evicted_at = time.time()
            evicted_log = (tmp_path / "g2.log").read_text()  # before the relaunch writes over it
            assert code != 0, _log(tmp_path, "g2")
            for name in ("g0", "g1"):
                assert procs[name].wait(timeout=600) == 0, _log(tmp_path, name)
            # A relaunch of the evicted group on the same node is refused while its record's cooldown lasts.
            procs["g2b"] = _start(tmp_path, "g2", "2", address)
            relaunch = procs["g2b"].wait(timeout=300)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # The slow group left with its health record, after an event named the eviction.
    record = read_record(tmp_path / "g2" / "checkpoints", node_name())
    assert record is not None and not record.healthy and record.source == "straggler", record
    assert record.until > evicted_at, record  # the cooldown is still on
    events = read_events(tmp_path / "g2")
    evicted = [e for e in events if e["event"] == "node_evicted"]
    assert len(evicted) == 1 and evicted[0]["replica_id"] == "2" and evicted[0]["source"] == "straggler", evicted
    assert evicted[0]["checkpoint_path"] is None  # no checkpoint: the live groups hold the state
    named = [e for e in events if e["event"] == "replica_straggler"]
    assert named and named[-1]["replica_id"] == "2" and named[-1]["evicted"], named
    assert any(e["event"] == "attempt_end" and e.get("exit_code") == NODE_UNAVAILABLE_EXIT_CODE for e in events)
    assert relaunch != 0 and any(e["event"] == "join_refused" for e in read_events(tmp_path / "g2")), _log(
        tmp_path, "g2"
    )
    # torchrun reports the SIGTERM that makes its agent leave as a crash (a traceback): one line said why, before it.
    explained = "lightning-ft: this node leaves the job: its torchrun agent"
    assert evicted_log.count(explained) == 1 and "SignalException" in evicted_log.split(explained)[1], evicted_log[
        -4000:
    ]
    slow = _records(tmp_path, "g2")
    last_slow_step = max(r["step"] for r in slow if r["time"] <= evicted_at)

    # The survivors never restarted, went on past the eviction, and saw a lost group.
    stalls = []
    for name in ("g0", "g1"):
        runs = _records(tmp_path, name)
        assert len({r["pid"] for r in runs}) == 1, f"{name} restarted"
        steps = [r["step"] for r in runs]
        assert steps == list(range(steps[0], MAX_STEPS + 1)), steps  # a group that joined late healed first
        assert any(r["step"] > last_slow_step + 5 for r in runs)
        their_events = read_events(tmp_path / name)
        lost = [e for e in their_events if e["event"] == "replica_lost"]
        assert [e["replica_id"] for e in lost] == ["2"], lost
        stalls.append(round(lost[0]["stall_s"], 3))
        assert [e["replica_id"] for e in their_events if e["event"] == "replica_straggler"][-1:] == ["2"]
        assert not any(e["event"] == "node_evicted" for e in their_events)
        assert json.loads((tmp_path / name / "done.json").read_text())["global_step"] == MAX_STEPS
    print(
        f"\nreplica eviction: group 2 named at step {named[-1]['step']} ({named[-1]['ratio']:.2f}x),"
        f" evicted after step {last_slow_step}; survivors' stall {stalls} s"
    )
