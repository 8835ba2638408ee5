"""Eviction through stock torchrun: a slowed node leaves, the others go on (with a waiting spare, at the same size).

Each torchrun agent is a simulated node (tests/e2e/_elastic_launch.py), named by ``LIGHTNING_FT_NODE_NAME`` so that
its health record is its own. The slowdown is real: every training step of the slow node's rank sleeps 300 ms
(tests/e2e/train_script.py, ``SlowOnNode``); ``StragglerMonitor(action="evict")`` names it from its measured step
times, every rank saves ``preempt-step=<N>``, the slow node's workers make their agent leave, and the other agents
form the next rendezvous round without it (or with a spare waiting beyond ``--nnodes`` MAX).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_ft.events import read_events
from lightning_ft.fault.internal import NODE_UNAVAILABLE_EXIT_CODE, HealthRecord, read_record, write_record
from tests.e2e._elastic_launch import ElasticJob
from tests.e2e._torchrun import SCRIPT, assert_ok, load_run, torchrun
from tests.e2e.test_elastic_launch import assert_every_sample_once, records, surviving
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SAMPLES, BATCH, MAX_STEPS = 96, 2, 24  # global batch 12: 8 steps per epoch on any world
WAIT_S = 600


def _common(root: Path, out: Path, accumulate: int, batch: int = BATCH) -> list[str]:
    args = ["--samples", str(SAMPLES), "--batch-size", str(batch), "--max-steps", str(MAX_STEPS)]
    args += ["--ckpt-every", "4", "--elastic-record", "--accumulate", str(accumulate)]
    return [*args, "--root", str(root), "--out", str(out)]


def _evicting(root: Path, out: Path, accumulate: int, batch: int = BATCH) -> list[str]:
    return [*_common(root, out, accumulate, batch), "--straggler-evict", "--slow-node", "node1", "--slow-ms", "300"]


def _health_gate(ckpt: Path, node: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lightning_ft.cli", "health-gate", "--dirpath", str(ckpt), "--node", node]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)


def _downtime(events: list[dict]) -> dict:
    resumed = [e for e in events if e["event"] == "resumed"]  # the eviction's: no checkpoint exists before it
    assert len(resumed) == 1, resumed
    e = resumed[0]
    return {k: e[k] and round(e[k], 2) for k in ("downtime_s", "detection_s", "rendezvous_s", "load_s", "first_step_s")}


def _assert_evicted(events: list[dict], ckpt: Path, *, saved: int, world: int) -> dict:
    evicted = [e for e in events if e["event"] == "node_evicted"]
    assert len(evicted) == 1, evicted
    event = evicted[0]
    assert event["host"] == "node1" and event["source"] == "straggler" and event["cooldown_s"] == 3600.0
    # The slow node's rank, as the straggler event named it, is the node that left.
    named = [e["suspect_rank"] for e in events if e["event"] == "straggler"]
    assert event["ranks"] == [named[0]], (event, named)
    record = read_record(ckpt, "node1")
    assert record is not None and not record.healthy and record.source == "straggler"
    assert record.until == pytest.approx(record.time + 3600.0) and record.refuses()
    assert Path(event["record_path"]) == ckpt / "lightning-ft" / "health" / "node1.json"
    assert event["checkpoint_path"].endswith(f"preempt-step={event['step']}")
    resumed = [e for e in events if e["event"] == "resumed" and e["attempt"] > event["attempt"]]
    assert [(e["saved_world_size"], e["world_size"]) for e in resumed] == [(saved, world)]
    assert resumed[0]["step"] == event["step"]  # nothing retrained: the eviction's own checkpoint
    assert resumed[0]["global_batch_after"] == 12
    return event


def test_a_slowed_node_is_evicted_and_training_finishes_without_it_seeing_each_sample_once(tmp_path):
    root, hold = tmp_path / "run", tmp_path / "hold"
    out, ckpt = root / "out", root / "ckpt"
    args = [*_evicting(root, out, accumulate=2), "--hold-file", str(hold)]
    job = ElasticJob(tmp_path, SCRIPT, args, min_nodes=2, max_nodes=3)
    # Training waits after its first batch until the world of 3 stands: on a loaded machine one agent may come
    # later than the round's last call, and the world then grows 2 -> 3 first (no checkpoint exists yet).
    hold.touch()
    try:
        for _ in range(3):
            job.start_node()
        job.wait_for(
            "the world of 3",
            lambda: any(e["event"] == "attempt_start" and e["world_size"] == 3 for e in read_events(root)),
            WAIT_S,
        )
        hold.unlink()
        live = [job.nodes[0], job.nodes[2]]
        job.wait_for(
            "the end of training",
            lambda: all(n.proc.poll() is not None for n in job.nodes),
            WAIT_S,
            may_fail=("node1",),
        )
        assert all(n.proc.returncode == 0 for n in live), job.logs()
        assert job.nodes[1].proc.returncode != 0, job.logs()  # its agent left on a signal (torchrun exits 1)
    finally:
        job.close()

    events = read_events(root)
    event = _assert_evicted(events, ckpt, saved=3, world=2)
    resumed = next(e for e in events if e["event"] == "resumed")
    assert resumed["accumulate_grad_batches"] == 3  # 2 nodes x 2 x 3 = the global batch of 3 x 2 x 2
    # The evicted node's ranks saved and exited with the documented code; the others with the restart code.
    ends = [e for e in events if e["event"] == "attempt_end" and e["attempt"] == event["attempt"]]
    codes = {e["rank"]: e["exit_code"] for e in ends}
    assert codes[event["ranks"][0]] == NODE_UNAVAILABLE_EXIT_CODE
    assert sorted(c for r, c in codes.items() if r not in event["ranks"]) == [75, 75]
    assert_every_sample_once(out)
    print("\neviction without a spare (3 -> 2), seconds:", _downtime(events))

    # Restarted within its cooldown, the node's job script is turned away before torchrun starts: one line, code 69.
    gate = _health_gate(ckpt, "node1")
    assert gate.returncode == NODE_UNAVAILABLE_EXIT_CODE, gate
    assert gate.stderr.count("\n") == 1 and "node 'node1' refuses to join: evicted by straggler" in gate.stderr
    assert _health_gate(ckpt, "node0").returncode == 0


@pytest.mark.extended
def test_a_waiting_spare_takes_the_evicted_node_s_place_and_the_weights_match_an_uninterrupted_run(tmp_path):
    root, hold = tmp_path / "run", tmp_path / "hold"
    out, ckpt = root / "out", root / "ckpt"
    # 2 x 6 per step without accumulation: with accumulate_grad_batches=3 on 2 ranks the monitor did not name the
    # slowed rank within 72 batches (it does with 3 ranks and accumulation 2, above, and here without accumulation).
    args = [*_evicting(root, out, accumulate=1, batch=6), "--hold-file", str(hold)]
    job = ElasticJob(tmp_path, SCRIPT, args, min_nodes=2, max_nodes=2)
    hold.touch()  # training waits after its first batch until the spare waits in the rendezvous
    try:
        job.start_node()
        job.start_node()
        job.wait_for(
            "the world of 2",
            lambda: any(e["event"] == "attempt_start" and e["world_size"] == 2 for e in read_events(root)),
            WAIT_S,
        )
        spare = job.start_node()  # beyond --nnodes MAX: torchrun keeps it waiting (its redundancy list)
        job.wait_for("the spare in the rendezvous", lambda: "Rendezvous'ing worker group" in spare.output(), WAIT_S)
        time.sleep(5)  # its join request reaches the store
        hold.unlink()
        live = [job.nodes[0], spare]
        job.wait_for(
            "the end of training",
            lambda: all(n.proc.poll() is not None for n in job.nodes),
            WAIT_S,
            may_fail=("node1",),
        )
        assert all(n.proc.returncode == 0 for n in live), job.logs()
        assert job.nodes[1].proc.returncode != 0, job.logs()  # left: the world of 2 after it is node0 and the spare
    finally:
        job.close()

    events = read_events(root)
    _assert_evicted(events, ckpt, saved=2, world=2)  # the spare in its place: the same size
    resumed = next(e for e in events if e["event"] == "resumed")
    assert resumed["accumulate_grad_batches"] == 1 and resumed["lr_scale"] == 1.0
    assert {r["rank"] for r in records(out, "samples") if r["attempt"] == resumed["attempt"]} == {0, 1}
    assert_every_sample_once(out)
    print("\neviction with a waiting spare (2 -> 2), seconds:", _downtime(events))

    # The reference: the same world of 2, never interrupted, without a slow node.
    ref = tmp_path / "ref"
    assert_ok(torchrun(*_common(ref, ref / "out", accumulate=1, batch=6), nproc=2, timeout=900))
    weights, _ = load_run(out)
    ref_weights, _ = load_run(ref / "out")
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        assert torch.equal(weights[name], value), name
    losses = {r["step"]: r["loss"] for rs in surviving(records(out, "losses")).values() for r in rs}
    reference = {r["step"]: r["loss"] for r in records(ref / "out", "losses")}
    # The eviction step's loss is not recorded (the monitor acts first in that batch-end hook); every other is exact.
    assert set(reference) - set(losses) == {resumed["step"]}
    assert losses == {step: reference[step] for step in losses}


def test_a_node_restarted_within_its_cooldown_refuses_to_join_with_one_line_and_code_69(tmp_path):
    root = tmp_path / "run"
    now = time.time()
    record = HealthRecord(
        host="sick", healthy=False, source="straggler", reason="rank 1 3.10x", time=now, until=now + 3600
    )
    write_record(root / "ckpt", record)
    env = subprocess_env(LIGHTNING_FT_NODE_NAME="sick")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    cmd += ["--max-restarts=3", str(SCRIPT), *_common(root, root / "out", accumulate=1)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "refuses to join" in line]
    assert len(lines) == 1, output
    assert lines[0].startswith("lightning-ft: node 'sick' refuses to join: evicted by straggler (rank 1 3.10x)")
    assert lines[0].endswith(f"exit code {NODE_UNAVAILABLE_EXIT_CODE}")
    assert proc.returncode != 0, output  # its agent left on a signal: no restarts, the rendezvous stays open
    events = read_events(root)
    refused = [e for e in events if e["event"] == "join_refused"]
    assert sorted(e["rank"] for e in refused) == [0, 1]
    assert all(e["host"] == "sick" and e["exit_code"] == 69 and e["until"] == record.until for e in refused)
    assert not [e for e in events if e["event"] in ("first_step", "health_check", "health_check_failed")]
    assert len([e for e in events if e["event"] == "attempt_start"]) == 2  # one attempt: torchrun did not restart
    ends = [e for e in events if e["event"] == "attempt_end"]
    assert [(e["reason"], e["exit_code"]) for e in ends] == [("stopped", 69)] * 2
    assert json.loads((root / "ckpt" / "lightning-ft" / "health" / "sick.json").read_text())["healthy"] is False


def test_a_node_failing_a_periodic_health_check_mid_run_is_evicted_and_training_finishes_without_it(tmp_path):
    # FaultPolicy(health_check_every_n_steps=2, health_check_action="evict"); from step 5 on node1's (fake) NVML
    # device reads uncorrected ECC errors: the check at step 6 fails there, and node1 leaves as a slowed node does.
    root, hold = tmp_path / "run", tmp_path / "hold"
    out, ckpt = root / "out", root / "ckpt"
    args = [*_common(root, out, accumulate=2), "--ecc-node", "node1:5", "--hold-file", str(hold)]
    job = ElasticJob(tmp_path, SCRIPT, args, min_nodes=2, max_nodes=3)
    hold.touch()  # as above: training starts once the world of 3 stands
    try:
        for _ in range(3):
            job.start_node()
        job.wait_for(
            "the world of 3",
            lambda: any(e["event"] == "attempt_start" and e["world_size"] == 3 for e in read_events(root)),
            WAIT_S,
        )
        hold.unlink()
        job.wait_for(
            "the end of training",
            lambda: all(n.proc.poll() is not None for n in job.nodes),
            WAIT_S,
            may_fail=("node1",),
        )
        assert all(n.proc.returncode == 0 for n in (job.nodes[0], job.nodes[2])), job.logs()
    finally:
        job.close()

    events = read_events(root)
    failed = [e for e in events if e["event"] == "health_check_failed" and e.get("periodic")]
    assert failed and failed[0]["step"] == 6, failed
    assert {(f["check"], f["rank"]) for f in failed[0]["checks"]} == {("gpu", r) for r in failed[0]["ranks"]}
    evicted = [e for e in events if e["event"] == "node_evicted"]
    assert len(evicted) == 1, evicted
    assert evicted[0]["host"] == "node1" and evicted[0]["source"] == "health_check" and evicted[0]["step"] == 6
    assert evicted[0]["ranks"] == failed[0]["ranks"]
    record = read_record(ckpt, "node1")
    assert record is not None and record.source == "health_check" and record.refuses()
    resumed = [e for e in events if e["event"] == "resumed"]
    assert [(e["saved_world_size"], e["world_size"], e["step"]) for e in resumed] == [(3, 2, 6)]
    assert_every_sample_once(out)
    assert _health_gate(ckpt, "node1").returncode == NODE_UNAVAILABLE_EXIT_CODE
