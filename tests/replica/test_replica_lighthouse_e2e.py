"""The lighthouse dies (docs/replica-groups.md, "When the lighthouse dies"): a ``lightning-ft lighthouse`` process is
SIGKILLed under replica groups that train, as a node loss or an OOM kill would end it.

- Restarted at the same address (what a Kubernetes Deployment, systemd or a restart loop in a SLURM script does;
  here examples/lighthouse/lighthouse_loop.sh, the SLURM recipe's loop, restarts it), it costs the groups the time it
  was down: no group exits or restarts, every group records the outage, and the run
  trains what it trains without the outage: every group bitwise equal to the others at every committed step, each
  step's samples those of the same step of one process with the global batch, and the final weights within
  :data:`~tests.replica.test_replica_scenario_e2e.FINAL_WEIGHTS_TOLERANCE` of it. After ~1 s (the
  downtime also holds the new process's start) and after ~60 s, both extended: the default tier's scenario
  (tests/replica/test_replica_scenario_e2e.py) restarts the lighthouse after 1 s and after 3 s.
- Kept down past ``ReplicaGroups(lighthouse_wait=...)``: the writing group commits ``preempt-step=<N>``, every group
  stops with one line naming the lighthouse and the time waited, its worker exiting with 75; relaunched with the
  lighthouse back, the groups resume from that checkpoint and end bitwise equal to the run without the outage.

The stall and the time to a clean stop are printed (``-s``); only generous bounds are asserted: the machine is loaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.e2e._torchrun import torchrun_popen
from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import Lighthouse, accepts
from tests.replica.test_replica_groups_e2e import STATE, _log, _records, _wait
from tests.replica.test_replica_scenario_e2e import FINAL_WEIGHTS_TOLERANCE

pytest.importorskip("torchft")

SCENARIO = Path(__file__).with_name("scenario_script.py")
REPLICA = Path(__file__).with_name("replica_script.py")
LOOP = Path(REPO_ROOT) / "examples" / "lighthouse" / "lighthouse_loop.sh"
SAMPLES, BATCH, ACCUMULATE, GROUPS = 1200, 4, 2, 3  # 50 steps of 3 groups x 2 micro-batches of 4
SCENARIO_STATE = ("weights", "optimizer", "scheduler", "lr", "rng", "loop")


class LoopedLighthouse:
    """examples/lighthouse/lighthouse_loop.sh running ``lightning-ft lighthouse`` (bound to 127.0.0.1, a port the OS
    chose at its first start): :meth:`kill_lighthouse` SIGKILLs the lighthouse, and the loop starts it again at the
    same address after ``restart_delay_s``."""

    def __init__(self, tmp: Path, *, min_replicas: int, restart_delay_s: float) -> None:
        env = subprocess_env(
            LIGHTHOUSE_COMMAND=f"{sys.executable} -m lightning_ft.cli lighthouse",
            LIGHTHOUSE_RESTART_DELAY_S=str(restart_delay_s),
        )
        self.env_file = tmp / "lighthouse.env"
        args = [str(self.env_file), "--bind", "127.0.0.1:0", "--min-replicas", str(min_replicas)]
        log = open(tmp / "lighthouse.log", "w")  # noqa: SIM115 - the child holds it
        self.loop = subprocess.Popen([str(LOOP), *args], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 180
        while not self.env_file.exists() or not self.env_file.read_text().strip():
            assert self.loop.poll() is None and time.monotonic() < deadline, (tmp / "lighthouse.log").read_text()
            time.sleep(0.2)
        self.address = self.env_file.read_text().strip().split("=", 1)[1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def _lighthouse_pid(self) -> int:
        children = subprocess.run(["pgrep", "-P", str(self.loop.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        return int(children[0])

    def kill_lighthouse(self) -> float:
        """SIGKILL the lighthouse (not the loop); return the time."""
        pid = self._lighthouse_pid()
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists() and accepts(self.port):
            time.sleep(0.01)
        return time.time()

    def wait_until_back(self, timeout_s: float = 300) -> float:
        """Block until the restarted lighthouse accepts connections; return the time."""
        deadline = time.monotonic() + timeout_s
        while not accepts(self.port):
            assert time.monotonic() < deadline, "the loop did not restart the lighthouse"
            time.sleep(0.05)
        return time.time()

    def stop(self) -> int:
        """SIGTERM the loop (it stops the lighthouse); return its exit code."""
        if self.loop.poll() is None:
            self.loop.terminate()
        try:
            return self.loop.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.loop.kill()
            return self.loop.wait()


def _events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / name) if e["event"] == event] if (tmp / name).exists() else []


def _stop_all(procs: dict[str, subprocess.Popen], workers: list[int] = ()) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------------ restarted


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run without failures: one process, no replica groups, accumulation 3 x 2 (the three groups' global
    batch), the same stream, seed and initial weights."""
    tmp = tmp_path_factory.mktemp("reference")
    args = ["--out", str(tmp / "ref"), "--samples", str(SAMPLES), "--batch-size", str(BATCH)]
    args += ["--strategy", "reference", "--accumulate", str(ACCUMULATE * GROUPS), "--policy", "keep_global"]
    proc = torchrun_popen(SCENARIO, *args, log=tmp / "ref.log")
    assert proc.wait(timeout=600) == 0, _log(tmp, "ref")
    return tmp / "ref"


def _restart_run(tmp: Path, reference: Path, outage_s: float) -> None:
    hold = tmp / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    house = LoopedLighthouse(tmp, min_replicas=2, restart_delay_s=outage_s)
    names = [f"g{i}" for i in range(GROUPS)]
    try:
        for i, name in enumerate(names):
            env = {
                "TORCHFT_LIGHTHOUSE": house.address,
                "REPLICA_GROUP_ID": str(i),
                "NUM_REPLICA_GROUPS": str(GROUPS),
                "LIGHTNING_FT_EVENT_LOG": "always",
            }
            args = ["--out", str(tmp / name), "--samples", str(SAMPLES), "--batch-size", str(BATCH)]
            args += ["--accumulate", str(ACCUMULATE), "--policy", "keep_global", "--min-replicas", "2"]
            procs[name] = torchrun_popen(SCENARIO, *args, log=tmp / f"{name}.log", env=env)
        _wait(lambda: all(len(_records(tmp, n)) >= 6 for n in names), "three groups training", 400, procs, tmp)
        killed = house.kill_lighthouse()
        up = house.wait_until_back()
        _wait(
            lambda: all(_records(tmp, n)[-1]["time"] > up for n in names), "a step after the restart", 400, procs, tmp
        )
        hold.unlink()
        for name, proc in procs.items():
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish:\n{_log(tmp, name)}")
            assert proc.returncode == 0, _log(tmp, name)
    finally:
        _stop_all(procs)
        stopped = house.stop()
    assert stopped == 0, (tmp / "lighthouse.log").read_text()  # SIGTERM: the loop stops the lighthouse, exits with 0
    assert "lighthouse 2 listening" in (tmp / "lighthouse.log").read_text()  # the loop's restart, at the same port

    runs = {name: _records(tmp, name) for name in names}
    by_step = {name: {r["step"]: r for r in records} for name, records in runs.items()}
    stalls = {}
    for name in names:
        events = read_events(tmp / name)
        # No group exited or restarted: one process, one attempt that finished, every step counted one by one.
        assert len({r["pid"] for r in runs[name]}) == 1, f"{name} restarted"
        assert [e["reason"] for e in events if e["event"] == "attempt_end"] == ["finished"], name
        steps = [r["step"] for r in runs[name]]
        healed = {e["step"] for e in events if e["event"] == "healed"}
        assert all(b == a + 1 or b - 1 in healed for a, b in zip(steps, steps[1:], strict=False)), (name, steps)
        # The outage is on record, once, with how long the lighthouse did not answer and what it cost the group.
        outages = [e for e in events if e["event"] == "lighthouse_outage"]
        assert len(outages) == 1, (name, outages)
        assert 0 < outages[0]["down_s"] <= up - killed + 2, (outages[0], up - killed)
        before = max(r["time"] for r in runs[name] if r["time"] < killed)
        after = min(r["time"] for r in runs[name] if r["time"] > up)
        stalls[name] = (round(after - before, 2), round(outages[0]["stall_s"], 2))
    # Every group bitwise equal to the others at every committed step they share, and at the end.
    for name in names:
        for record in runs[name]:
            for other in names:
                theirs = by_step[other].get(record["step"])
                if theirs is not None:
                    assert {k: record[k] for k in SCENARIO_STATE} == {k: theirs[k] for k in SCENARIO_STATE}, (
                        name,
                        other,
                        record["step"],
                    )
    import torch

    finals = {name: torch.load(tmp / name / "final0.pt") for name in names}
    assert all(all(torch.equal(f[k], finals["g0"][k]) for k in f) for f in finals.values())
    # What the run trained is what it trains without the outage: each committed step the samples of the same step of
    # one process with the global batch, and the same weights at the end (to the rounding of the summation order).
    ref = {r["step"]: r for r in _records(reference.parent, reference.name)}
    trained: dict[int, set[int]] = {}
    for records in runs.values():
        for r in records:
            trained.setdefault(r["step"], set()).update(i for batch in r["batches"] for i in batch)
    assert trained.keys() == ref.keys()
    for step, samples in trained.items():
        assert samples == {i for batch in ref[step]["batches"] for i in batch}, step
    expected = torch.load(reference / "final0.pt")
    worst = max(float((finals["g0"][k] - expected[k]).abs().max()) for k in expected)
    assert worst <= FINAL_WEIGHTS_TOLERANCE, worst
    # Nothing else: no group left the quorum or healed after the outage (a restarted lighthouse knows no group: each
    # group's heartbeat within 0.1 s of its start lets its first quorum wait for all three), and no step was discarded
    # (a quorum id repeated by the restarted lighthouse would have kept or reused a process group's rendezvous).
    lost = {n: [e["replica_id"] for e in _events(tmp, n, "replica_lost") if e["time"] > killed] for n in names}
    healed = {n: [e["step"] for e in _events(tmp, n, "healed") if e["time"] > killed] for n in names}
    discarded = {
        n: [e["step"] for e in _events(tmp, n, "replica_data") if e["time"] > killed and e["reason"] == "discarded"]
        for n in names
    }
    print(
        f"\nlighthouse down {up - killed:.2f} s (SIGKILL, restart after {outage_s:g} s): per group (gap between"
        f" commits around it, its lighthouse_outage stall_s) {stalls}; final weights vs one process {worst:.3g};"
        f" after the outage: groups lost {lost}, heals {healed}, discarded steps {discarded}"
    )
    assert not any(lost.values()) and not any(healed.values()) and not any(discarded.values())
    for gap, _ in stalls.values():
        assert gap < up - killed + 60, stalls  # sanity only: the machine is loaded


@pytest.mark.slow
@pytest.mark.extended  # the default tier's scenario (test_replica_scenario_e2e.py) restarts the lighthouse after 1 s
@pytest.mark.timeout(1200)
def test_a_lighthouse_restarted_at_its_address_costs_the_groups_only_its_downtime(
    tmp_path: Path, reference: Path
) -> None:
    _restart_run(tmp_path, reference, outage_s=1.0)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(1500)
def test_a_lighthouse_down_for_a_minute_costs_the_groups_only_its_downtime(tmp_path: Path, reference: Path) -> None:
    _restart_run(tmp_path, reference, outage_s=60.0)


# ------------------------------------------------------------------------------------------------ stays down

MAX_STEPS, EVERY_N, WAIT_S = 18, 5, 6.0


def _start_group(tmp: Path, name: str, replica_id: str, address: str) -> subprocess.Popen:
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(REPLICA), "--out", str(tmp / name), "--max-steps", str(MAX_STEPS)]
    cmd += ["--ckpt-dir", str(tmp / "ckpt"), "--every-n", str(EVERY_N), "--min-replicas", "2"]
    cmd += ["--lighthouse-wait-s", str(WAIT_S)]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two groups that train ``MAX_STEPS`` steps without an outage, sharing one checkpoint folder."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    procs: dict[str, subprocess.Popen] = {}
    house = Lighthouse(tmp, min_replicas=2)
    try:
        for i in range(2):
            procs[f"g{i}"] = _start_group(tmp, f"g{i}", str(i), house.address)
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, _log(tmp, name)
    finally:
        _stop_all(procs)
        house.stop()
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_lighthouse_that_stays_down_stops_the_groups_after_a_checkpoint_that_a_relaunch_resumes_exactly(
    tmp_path: Path, uninterrupted: Path
) -> None:
    import torch

    hold = tmp_path / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    house = Lighthouse(tmp_path, min_replicas=2)
    workers: list[int] = []
    try:
        for i in range(2):
            procs[f"g{i}"] = _start_group(tmp_path, f"g{i}", str(i), house.address)
        # Past the periodic checkpoint at step 10, before the one at 15.
        _wait(lambda: all(len(_records(tmp_path, n)) >= 12 for n in procs), "step 12", 400, procs, tmp_path)
        workers = [_records(tmp_path, n)[-1]["pid"] for n in procs]
        killed = house.kill()
        exits = {}
        for name, proc in procs.items():
            try:
                proc.wait(timeout=WAIT_S + 120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not stop:\n{_log(tmp_path, name)}")
            exits[name] = time.time() - killed
        stopped_at = {n: _records(tmp_path, n)[-1]["step"] for n in procs}
        assert 10 < stopped_at["g0"] == stopped_at["g1"] < 15, stopped_at

        # Each group stopped on its own, with one line naming the lighthouse and the time waited; the worker's exit
        # code is FaultPolicy.exit_code (75), and the writer (group 0) committed the state of the last step.
        step = stopped_at["g0"]
        for name in procs:
            text = (tmp_path / f"{name}.log").read_text()
            said = re.findall(rf"lightning-ft: the lighthouse {house.address} did not answer for (\d+) s.*", text)
            assert len(said) == 1 and float(said[0]) >= WAIT_S - 1, said
            assert "exitcode  : 75" in text, _log(tmp_path, name)
            lost = _events(tmp_path, name, "lighthouse_lost")
            assert len(lost) == 1 and lost[0]["step"] == step and lost[0]["waited_s"] >= WAIT_S, lost
            ends = _events(tmp_path, name, "attempt_end")
            assert [(e["reason"], e["exit_code"]) for e in ends] == [("stopped", 75)], ends
        assert _events(tmp_path, "g0", "lighthouse_lost")[0]["checkpoint_path"] == str(
            tmp_path / "ckpt" / f"preempt-step={step}"
        )
        assert _events(tmp_path, "g1", "lighthouse_lost")[0]["checkpoint_path"] is None
        committed = [e["step"] for e in _events(tmp_path, "g0", "checkpoint_committed")]
        assert committed[-1] == step and _events(tmp_path, "g1", "checkpoint_committed") == []
        clean_stop = {n: round(_events(tmp_path, n, "lighthouse_lost")[0]["time"] - killed, 1) for n in procs}
        # The process ends soon after: not held by torchft's quorum request to the dead lighthouse, whose deadline
        # (the quorum timeout plus lighthouse_wait plus the connect timeout: 52 s here) nothing cancels.
        assert all(exits[n] < clean_stop[n] + 35 for n in procs), (exits, clean_stop)

        # Relaunched with the lighthouse back (the same command): both resume from preempt-step=<N> and end where the
        # run without the outage ends, bitwise, step by step.
        house.start()
        hold.unlink()
        for i in range(2):
            procs[f"g{i}"] = _start_group(tmp_path, f"g{i}", str(i), house.address)
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, _log(tmp_path, name)
    finally:
        _stop_all(procs, [pid for pid in workers if Path(f"/proc/{pid}").exists()])
        house.stop()

    ref = {r["step"]: r for r in _records(uninterrupted, "g0")}
    for name in ("g0", "g1"):
        resumed = _events(tmp_path, name, "resumed")
        assert [e["step"] for e in resumed] == [step], resumed
        records = _records(tmp_path, name)
        after = [r for r in records if r["pid"] != records[0]["pid"]]
        assert after[0]["step"] == step + 1 and after[-1]["step"] == MAX_STEPS
        for record in after:
            assert {k: record[k] for k in STATE} == {k: ref[record["step"]][k] for k in STATE}, record["step"]
        final = torch.load(tmp_path / name / "final0.pt")
        expected = torch.load(uninterrupted / name / "final0.pt")
        assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final), name
    print(
        f"\nlighthouse kept down (lighthouse_wait {WAIT_S:g} s): lighthouse_lost after {clean_stop} s, the groups'"
        f" torchrun exited after {json.dumps({n: round(s, 1) for n, s in exits.items()})} s; resumed from step {step}"
    )
