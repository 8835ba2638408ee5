"""The ElasticPolicy at a change of the live replica groups, end to end: three one-process groups under torchrun
(``min_replicas=2``, per-device batch 8, ``accumulate_grad_batches=2``), one SIGKILLed mid-run and replaced later.

- ``keep_global``: the global batch of the full membership (3 groups x 8 x 2 = 48 samples, 6 micro-batches) is kept:
  accumulation 3 while two groups are live, 2 again once the replacement healed. A float64 model, so that the
  summation order rounds at ~1e-16: the survivors' and the healed group's final weights equal, to rtol 1e-9, those of
  one process trained on the same sample stream with ``accumulate_grad_batches=6`` (a lost or repeated sample, or a
  wrong accumulation, moves them by ~1e-3 relative), and every committed step trained exactly the sample ids of the
  reference's step.
- ``keep_local`` + ``linear``: the accumulation stays 2 and the learning rate is 2/3 of the run's own schedule while
  two groups are live, in the optimizer's ``param_groups`` (what LearningRateMonitor reads); the healed group's rate
  and accumulation are the survivors' bitwise at its first committed step.

The run: tests/replica/replica_script.py (``--deterministic``: float64, SGD, no dropout or noise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_ft.events import read_events
from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_groups_e2e import SCRIPT, _log, _records, _start, _wait

pytest.importorskip("torchft")

MAX_STEPS = 300
BATCH = 8  # replica_script.py's per-device batch
RTOL, ATOL = 1e-9, 1e-12


def _run_with_a_lost_and_replaced_group(tmp: Path, policy: str) -> dict[str, list[dict[str, Any]]]:
    """Three groups; group 2 SIGKILLed once all three committed steps; the survivors go on alone for a while; a
    replacement (same id) heals and trains; then the run finishes at full speed. Returns the records per group
    (``g2`` the killed one, ``g2b`` its replacement)."""
    hold = tmp / "hold"
    hold.touch()
    args = ("--policy", policy, "--accumulate", "2", "--deterministic", "--min-replicas", "2")
    args += ("--max-steps", str(MAX_STEPS))
    procs: dict[str, subprocess.Popen] = {}
    try:
        # A join timeout of 2 s: on a loaded machine a group more than 0.5 s late for a quorum sits it out (and heals at
        # the next), and the three would rarely share one.
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=2000) as address:
            for i in range(3):
                procs[f"g{i}"] = _start(tmp, f"g{i}", str(i), address, policy=policy, args=args)
            # The kill must end a quorum of three: each group's newest record is the same committed step, which only
            # the groups of that step's quorum record.
            _wait(lambda: _in_one_quorum(tmp, ("g0", "g1", "g2")), "3 groups in one quorum", 300, procs, tmp)
            os.kill(_records(tmp, "g2")[-1]["pid"], signal.SIGKILL)  # mid-step (steps sleep while held)
            procs["g2"].kill()
            procs["g2"].wait(timeout=60)
            step_at_kill = _records(tmp, "g0")[-1]["step"]
            _wait(
                lambda: all(_records(tmp, f"g{i}")[-1]["step"] >= step_at_kill + 5 for i in range(2)),
                "the survivors to go on",
                120,
                procs,
                tmp,
            )
            procs["g2b"] = _start(tmp, "g2b", "2", address, policy=policy, args=args)
            _wait(lambda: len(_records(tmp, "g2b")) >= 3, "the replacement to commit steps", 300, procs, tmp)
            hold.unlink()
            for name in ("g0", "g1", "g2b"):
                try:
                    procs[name].wait(timeout=300)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"{name} did not finish:\n{_log(tmp, name)}")
                assert procs[name].returncode == 0, _log(tmp, name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    runs = {name: _records(tmp, name) for name in ("g0", "g1", "g2", "g2b")}
    for name in ("g0", "g1"):
        assert len({r["pid"] for r in runs[name]}) == 1, f"{name} restarted"
    return runs


def _in_one_quorum(tmp: Path, names: tuple[str, ...]) -> bool:
    records = [_records(tmp, name) for name in names]
    return all(len(r) >= 3 for r in records) and len({r[-1]["step"] for r in records}) == 1


def _by_step(runs: dict[str, list[dict[str, Any]]]) -> dict[int, dict[str, dict[str, Any]]]:
    steps: dict[int, dict[str, dict[str, Any]]] = {}
    for name, records in runs.items():
        for r in records:
            steps.setdefault(r["step"], {})[name] = r
    return steps


def _policy_events(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / name) if e["event"] == "replica_policy"]


def _assert_healed_group_is_the_survivors(runs: dict[str, list[dict[str, Any]]]) -> None:
    first = runs["g2b"][0]
    for survivor in ("g0", "g1"):
        theirs = {r["step"]: r for r in runs[survivor]}[first["step"]]
        for key in ("accumulate", "lr", "weights", "optimizer", "scheduler", "loop"):
            assert first[key] == theirs[key], (key, first, theirs)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_keep_global_trains_the_reference_steps_through_a_lost_and_a_healed_group(tmp_path: Path) -> None:
    import torch

    runs = _run_with_a_lost_and_replaced_group(tmp_path, "keep_global")
    # The reference: one process, the same stream (ElasticFT3D's resumable sampler), 6 micro-batches per step.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += [str(SCRIPT), "--out", str(tmp_path / "ref"), "--strategy", "elastic", "--deterministic"]
    cmd += ["--accumulate", "6", "--max-steps", str(MAX_STEPS)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = {r["step"]: r for r in _records(tmp_path, "ref")}
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))

    # Each committed step trained the reference step's samples, over the groups that took part, each once: with 3
    # groups at accumulation 2, with 2 at accumulation 3. The step group 2 died in may be committed without its record.
    killed_in = runs["g2"][-1]["step"] + 1
    memberships = set()
    for step, groups in sorted(_by_step(runs).items()):
        trained = sorted(i for r in groups.values() for i in r["step_samples"])
        expected = sorted(reference[step]["step_samples"])
        assert len(expected) == 6 * BATCH
        if trained != expected and step == killed_in and "g2" not in groups:
            assert set(trained) < set(expected) and len(set(trained)) == len(trained), step
            continue
        assert trained == expected, (step, sorted(groups), len(trained))
        assert {r["accumulate"] for r in groups.values()} == {6 // len(groups)}, (step, groups.keys())
        memberships.add(len(groups))
    assert memberships == {2, 3}, memberships

    # The final weights: the survivors and the healed group equal the reference's, to the rounding of the order.
    expected_weights = torch.load(tmp_path / "ref" / "final0.pt")
    worst = 0.0
    for name in ("g0", "g1", "g2b"):
        got = torch.load(tmp_path / name / "final0.pt")
        assert got.keys() == expected_weights.keys()
        for key, value in expected_weights.items():
            assert value.dtype == torch.float64
            assert torch.allclose(got[key], value, rtol=RTOL, atol=ATOL), (name, key, (got[key] - value).abs().max())
            worst = max(worst, float(((got[key] - value).abs() / value.abs().clamp_min(1e-3)).max()))
    # Every step of the reference was committed by some group (a group may sit out a quorum at the start and heal).
    assert set(_by_step(runs)) == set(reference)
    _assert_healed_group_is_the_survivors(runs)

    # Said in the console (group rank 0) and in the event log, once per change.
    # (A group that heals at a quorum takes its source's membership and says only the changes after it.)
    changes = {
        name: [
            (e["live_groups"], e["accumulate_grad_batches"], e["global_batch"]) for e in _policy_events(tmp_path, name)
        ]
        for name in ("g0", "g1")
    }
    assert any((2, 3, 48) in c for c in changes.values()), changes
    assert all(c[-1] == (3, 2, 48) for c in changes.values()), changes
    assert all(
        e["lr_scale"] == 1.0 and e["batch"] == "keep_global" for n in changes for e in _policy_events(tmp_path, n)
    )
    line = "lightning-ft: replica groups 3 -> 2 live (of 3): gradient accumulation 2 -> 3, global batch 48 (unchanged)"
    assert any(line in (tmp_path / f"{name}.log").read_text() for name in ("g0", "g1"))
    assert (3, 2) in [(e["live_groups"], e["accumulate_grad_batches"]) for e in _policy_events(tmp_path, "g2b")]
    print(f"\nkeep_global: largest relative weight difference to the reference {worst:.2e} (rtol {RTOL})")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_keep_local_scales_the_learning_rate_by_the_live_groups_on_survivors_and_the_healed_group(
    tmp_path: Path,
) -> None:
    runs = _run_with_a_lost_and_replaced_group(tmp_path, "keep_local")
    by_step = _by_step(runs)
    killed_in = runs["g2"][-1]["step"] + 1
    seen = set()
    for step, groups in sorted(by_step.items()):
        if step == killed_in:
            continue
        n = len(groups)
        # StepLR(step_size=7, gamma=0.9) on 0.05: the rate of the next step, times the live groups' factor.
        own = 0.05 * 0.9 ** (step // 7)
        for r in groups.values():
            assert r["accumulate"] == 2 and len(r["step_samples"]) == 2 * BATCH, (step, r)
            assert r["lr"] == pytest.approx(own * n / 3, rel=1e-12), (step, n, r["lr"], own)
        seen.add(n)
    assert seen == {2, 3}, seen
    _assert_healed_group_is_the_survivors(runs)
    events = {name: _policy_events(tmp_path, name) for name in ("g0", "g1")}
    assert any((2, 2 / 3) in [(e["live_groups"], e["lr_scale"]) for e in ev] for ev in events.values()), events
    assert all((ev[-1]["live_groups"], ev[-1]["lr_scale"]) == (3, 1.0) for ev in events.values()), events
    assert all(e["accumulate_grad_batches"] == 2 for ev in events.values() for e in ev)
    line = "gradient accumulation 2 (unchanged), global batch 48 -> 32, LR x1.00 -> x0.67"
    assert any(line in (tmp_path / f"{name}.log").read_text() for name in ("g0", "g1"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_groups_of_accumulation_one_under_keep_global_stop_at_set_up_before_any_step(tmp_path: Path) -> None:
    with lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
        env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="3")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
        cmd += [str(SCRIPT), "--out", str(tmp_path / "g0"), "--policy", "keep_global", "--max-steps", "5"]
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ValueError: ElasticPolicy(batch='keep_global') keeps the global batch of the full membership, 24" in out
    assert "ReplicaGroups(min_replicas=3)" in out and "ElasticPolicy(batch='keep_local')" in out
    assert _records(tmp_path, "g0") == []
