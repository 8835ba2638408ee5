"""The memory tier with replica groups: two one-process groups under torchrun, ``ElasticFT3D(memory_tier=
MemoryTier(every_n_train_steps=3))`` beside ``ModelCheckpoint(every_n_train_steps=5)`` in one shared folder, one run id
for the job (``LIGHTNING_FT_RUN_ID``) and one memory folder for both groups (``LIGHTNING_FT_MEMORY_DIR``: two groups on
one node's ``/dev/shm``, the harder case: each group must keep its own copies).

- Every group SIGKILLed (workers and torchrun agents) when the memory tier holds step 18 and the durable checkpoint is
  step 15; relaunched: both resume from the memory tier's step 18 (``resumed`` says ``tier="local"``) and end bitwise
  equal to the run without a failure (tests/replica/test_replica_checkpoints_e2e.py's).
- The same, with group 0's memory copy damaged (one byte flipped) and group 1's missing: both resume from the durable
  checkpoint of step 15 (group 0 writes ``checkpoint_rejected``), bitwise equal too.
- A group that heals from a live group drops its memory copies of the state the heal replaced, so a later whole-job
  restart can never resume that older state from its node.

The run: tests/replica/replica_script.py (``--memory-every``, ``--pause-at``). Times are never asserted.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_checkpoints_e2e import (
    _events,
    _finish,
    _kill,
    _same,
    _start,
    _stop_all,
    _weights,
    uninterrupted,  # noqa: F401 - the fixture: two groups without a failure
)
from tests.replica.test_replica_groups_e2e import STATE, _records, _wait

pytest.importorskip("torchft")

MEMORY_EVERY = 3
PAUSE_AT = 18  # the memory tier's step 18 is newer than the durable checkpoint of step 15


def _memory_env(tmp: Path) -> dict[str, str]:
    return {"LIGHTNING_FT_MEMORY_DIR": str(tmp / "shm"), "LIGHTNING_FT_RUN_ID": "job"}


def _memory_copy(tmp: Path, name: str, step: int) -> Path:
    """The group's committed memory copy of ``step`` (its rank 0), from its ``checkpoint_committed`` event."""
    [event] = [e for e in _events(tmp, name, "checkpoint_committed") if e.get("tier") == "memory" and e["step"] == step]
    return Path(event["path"])


def _flip_a_byte(folder: Path) -> Path:
    """Flip one byte in the middle of the largest file of ``folder`` (the tensor data): the fault a CRC must catch."""
    target = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("memory", ["intact", "damaged"])
def test_a_whole_job_restart_resumes_from_the_memory_tier_else_the_durable_checkpoint_exactly(
    tmp_path: Path,
    uninterrupted: Path,  # noqa: F811
    memory: str,
) -> None:
    env = _memory_env(tmp_path)
    extra = ("--memory-every", str(MEMORY_EVERY))
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(
                    tmp_path, f"g{i}", str(i), address, extra=(*extra, "--pause-at", str(PAUSE_AT)), env=env
                )
            _wait(
                lambda: all((tmp_path / n / "paused").exists() for n in procs),
                f"both groups at step {PAUSE_AT}",
                300,
                procs,
                tmp_path,
            )
            for name in list(procs):
                _kill(procs, tmp_path, name)
            # Each group committed its own memory copy of step 18 (two folders: one per group); the durable
            # checkpoint's newest is step 15, written once, by group 0.
            copies = {name: _memory_copy(tmp_path, name, PAUSE_AT) for name in procs}
            assert copies["g0"] != copies["g1"] and all(p.is_dir() for p in copies.values()), copies
            durable = max(
                e["step"] for e in _events(tmp_path, "g0", "checkpoint_committed") if e.get("tier") != "memory"
            )
            assert durable == 15 and _events(tmp_path, "g1", "checkpoint_committed")[-1]["tier"] == "memory"
            if memory == "damaged":
                flipped = _flip_a_byte(copies["g0"])
                shutil.rmtree(copies["g1"])
            for i in range(2):  # the relaunch: the same ids, folders and memory folder
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address, extra=extra, env=env)
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    expected_step, expected_tier = (PAUSE_AT, "local") if memory == "intact" else (durable, "durable")
    for name in ("g0", "g1"):
        [resumed] = _events(tmp_path, name, "resumed")
        assert (resumed["step"], resumed["tier"]) == (expected_step, expected_tier), resumed
        after = [r for r in _records(tmp_path, name) if r["pid"] != _records(tmp_path, name)[0]["pid"]]
        assert after[0]["step"] == expected_step + 1, after[0]
        assert [e for e in _events(tmp_path, name, "healed") if e["step"] > 0] == [], name  # they agreed at once
        # ... and end bitwise equal to the run without a failure.
        assert _same(_weights(tmp_path / name / "final0.pt"), _weights(uninterrupted / name / "final0.pt")), name
        ref = {r["step"]: r for r in _records(uninterrupted, name)}
        for record in after:
            assert {k: record[k] for k in STATE} == {k: ref[record["step"]][k] for k in STATE}, (name, record["step"])
    if memory == "damaged":
        rejected = [e for e in _events(tmp_path, "g0", "checkpoint_rejected") if e.get("tier") == "local"]
        assert rejected and rejected[0]["step"] == PAUSE_AT and str(copies["g0"]) in rejected[0]["path"], rejected
        assert flipped.is_relative_to(copies["g0"])


def _lane(tmp: Path, name: str) -> list[int]:
    """The steps of the memory copies group ``name``'s rank 0 holds in its own folder."""
    committed = [e for e in _events(tmp, name, "checkpoint_committed") if e.get("tier") == "memory"]
    if not committed:
        return []
    lane = Path(committed[0]["path"]).parent
    return sorted(int(p.name.split("=")[1]) for p in lane.glob("step=*")) if lane.is_dir() else []


def _heals(tmp: Path) -> list[dict[str, Any]]:
    """The heals of group 1's replacement (its second attempt; in the first, started apart from group 0 under
    ``min_replicas=1``, it may have healed too)."""
    return [e for e in _events(tmp, "g1", "healed") if e["attempt"] == 1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_group_that_heals_from_a_live_group_drops_its_older_memory_copies(tmp_path: Path) -> None:
    """Group 1 is SIGKILLed with a memory copy of step 10 on its node; group 0 trains on; the replacement for group 1
    (same node, same memory folder) heals from group 0 and reads no checkpoint, and its copy of step 10 (the state
    the heal replaced) is gone before its first step after the heal, not only at its next memory save."""
    hold = tmp_path / "hold"
    hold.touch()
    env = _memory_env(tmp_path)
    extra = ("--memory-every", "10", "--step-sleep", "0.5")
    max_steps = 300
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address, max_steps=max_steps, extra=extra, env=env)
            _wait(lambda: _lane(tmp_path, "g1") == [10], "group 1's memory copy of step 10", 300, procs, tmp_path)
            _kill(procs, tmp_path, "g1")
            del procs["g1"]
            assert _lane(tmp_path, "g1") == [10]
            _wait(lambda: _records(tmp_path, "g0")[-1]["step"] >= 13, "group 0 at step 13", 300, procs, tmp_path)
            procs["g1"] = _start(tmp_path, "g1", "1", address, max_steps=max_steps, extra=extra, env=env)
            _wait(lambda: _heals(tmp_path), "the heal", 300, procs, tmp_path)
            stale = _lane(tmp_path, "g1")  # at once: its next memory save (which replaces the copy) is steps away
            healed = _heals(tmp_path)
            step = healed[0]["step"]
            hold.unlink()
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    assert healed[0]["source"] == "0" and step > 10, healed
    assert _events(tmp_path, "g1", "resumed") == []  # no checkpoint read, no memory copy either
    assert 10 not in stale, f"group 1 still holds its memory copy of step 10 after healing at step {step}: {stale}"
    assert _same(_weights(tmp_path / "g0" / "final0.pt"), _weights(tmp_path / "g1" / "final0.pt"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_group_never_gives_up_a_newer_memory_copy_to_heal_from_an_older_live_group(tmp_path: Path) -> None:
    """A whole-job restart with ``min_replicas=1``, the groups relaunched apart: group 1's node lost its memory copy,
    so it resumes from the durable checkpoint of step 15 and trains alone (slowly here: 6 s a step, so that it is
    still below step 18); group 0, relaunched then with its memory copy of step 18, resumes it rather than heal from
    the live group 1 (which is older), and group 1 heals from group 0 at the next quorum: the job goes on from step
    18, not from group 1's older step."""
    env = _memory_env(tmp_path)
    extra = ("--memory-every", str(MEMORY_EVERY))
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:  # in step
            for i in range(2):
                procs[f"g{i}"] = _start(
                    tmp_path, f"g{i}", str(i), address, extra=(*extra, "--pause-at", str(PAUSE_AT)), env=env
                )
            _wait(lambda: all((tmp_path / n / "paused").exists() for n in procs), "the pause", 300, procs, tmp_path)
            for name in list(procs):
                _kill(procs, tmp_path, name)
        # The relaunch: a group may train alone (min_replicas=1).
        with lighthouse(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            shutil.rmtree(_memory_copy(tmp_path, "g1", PAUSE_AT))  # group 1's node lost its memory
            hold = tmp_path / "hold"
            hold.touch()  # while it exists, each step sleeps --step-sleep
            extra = (*extra, "--step-sleep", "6")
            procs = {"g1": _start(tmp_path, "g1", "1", address, extra=extra, env=env)}
            _wait(  # (its `resumed` event comes with its first committed step)
                lambda: any(q["attempt"] == 1 for q in _events(tmp_path, "g1", "replica_quorum")),
                "group 1 in a quorum after its resume",
                300,
                procs,
                tmp_path,
            )
            procs["g0"] = _start(tmp_path, "g0", "0", address, extra=extra, env=env)
            first_pid = _records(tmp_path, "g0")[0]["pid"]
            _wait(
                lambda: any(r["pid"] != first_pid for r in _records(tmp_path, "g0")),
                "group 0's first step after its relaunch",
                300,
                procs,
                tmp_path,
            )
            hold.unlink()
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    [resumed1] = _events(tmp_path, "g1", "resumed")
    assert (resumed1["step"], resumed1["tier"]) == (15, "durable"), resumed1
    [resumed0] = _events(tmp_path, "g0", "resumed")
    assert (resumed0["step"], resumed0["tier"]) == (PAUSE_AT, "local"), resumed0
    after = [r for r in _records(tmp_path, "g0") if r["pid"] != first_pid]
    assert after[0]["step"] == PAUSE_AT + 1, after[0]  # no rewind to step 15
    assert [e for e in _events(tmp_path, "g0", "healed") if e["attempt"] == 1] == []
    healed = [e for e in _events(tmp_path, "g1", "healed") if e["attempt"] == 1]
    assert healed and healed[0]["source"] == "0" and healed[0]["step"] >= PAUSE_AT, healed
    g1 = _records(tmp_path, "g1")
    before = [r["step"] for r in g1 if r["pid"] != g1[0]["pid"] and r["time"] < healed[0]["time"]]
    assert before and all(step < PAUSE_AT for step in before), before  # group 1 trained alone, below step 18
    assert _same(_weights(tmp_path / "g0" / "final0.pt"), _weights(tmp_path / "g1" / "final0.pt"))
