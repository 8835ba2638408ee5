"""Checkpoints and auto-resume with replica groups: two one-process groups under torchrun share one
``ModelCheckpoint(dirpath=..., every_n_train_steps=5)`` folder.

- One group writes each checkpoint (the lowest replica id in the step's quorum); the files are Lightning's.
- Every group SIGKILLed and relaunched (a whole-job failure): both resume from the newest committed checkpoint and end
  bitwise equal to the uninterrupted run.
- A replacement that joins a live quorum heals from a live group and reads no checkpoint, even though the folder holds
  one; while the writer is missing, the other group writes.

The run: tests/replica/replica_script.py (``--ckpt-dir``). Times are never asserted.
"""

from __future__ import annotations

import json
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
from tests.replica.test_replica_groups_e2e import STATE, _log, _records, _wait

pytest.importorskip("torchft")

SCRIPT = Path(__file__).with_name("replica_script.py")
MAX_STEPS = 40
EVERY_N = 5


def _start(
    tmp: Path,
    name: str,
    replica_id: str,
    address: str,
    *,
    max_steps: int = MAX_STEPS,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Launch group ``replica_id`` (torchrun, one process) of replica_script.py into ``tmp/name``; ``extra``: more
    arguments of the script, ``env``: more environment variables."""
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="2", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--max-steps", str(max_steps)]
    cmd += ["--ckpt-dir", str(tmp / "ckpt"), "--every-n", str(EVERY_N), *extra]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp / name) if e["event"] == event] if (tmp / name).exists() else []


def _finish(procs: dict[str, subprocess.Popen], tmp: Path) -> None:
    for name, proc in procs.items():
        try:
            proc.wait(timeout=500)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish:\n{_log(tmp, name)}")
        assert proc.returncode == 0, _log(tmp, name)


def _kill(procs: dict[str, subprocess.Popen], tmp: Path, name: str) -> None:
    """SIGKILL the group's worker (mid-step) and its torchrun agent: the whole group is gone, as with a lost node."""
    os.kill(_records(tmp, name)[-1]["pid"], signal.SIGKILL)
    procs[name].kill()
    procs[name].wait(timeout=60)


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _weights(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two groups that train ``MAX_STEPS`` steps without a failure, sharing one checkpoint folder."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(tmp, f"g{i}", str(i), address)
            _finish(procs, tmp)
    finally:
        _stop_all(procs)
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_group_writes_each_checkpoint_to_the_shared_folder(uninterrupted: Path) -> None:
    import torch

    tmp = uninterrupted
    # Lightning's own file names, one per save, each written once: by group 0 (the lowest id), never by group 1.
    names = sorted(p.name for p in (tmp / "ckpt").iterdir())
    expected = sorted(f"epoch=0-step={s}.ckpt" for s in range(EVERY_N, MAX_STEPS + 1, EVERY_N))
    assert names == expected, names
    writer = _events(tmp, "g0", "checkpoint_committed")
    assert [e["step"] for e in writer] == list(range(EVERY_N, MAX_STEPS + 1, EVERY_N))
    assert _events(tmp, "g1", "checkpoint_committed") == []
    # The files are Lightning's checkpoints of the committed state: the step's global_step, and the last one holds
    # the weights both groups ended with.
    last = torch.load(tmp / "ckpt" / f"epoch=0-step={MAX_STEPS}.ckpt", weights_only=False)
    assert last["global_step"] == MAX_STEPS
    final = _weights(tmp / "g1" / "final0.pt")
    assert _same(
        {k.removeprefix("net."): v for k, v in last["state_dict"].items()},
        {k.removeprefix("net."): v for k, v in final.items()},
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_group_killed_and_relaunched_resumes_from_the_checkpoint_exactly(
    tmp_path: Path, uninterrupted: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address)
            # Past the checkpoint at step 15, not yet at the one at step 20: the restart redoes a few steps.
            _wait(
                lambda: (
                    any(e["step"] == 3 * EVERY_N for e in _events(tmp_path, "g0", "checkpoint_committed"))
                    and _records(tmp_path, "g0")[-1]["step"] >= 3 * EVERY_N + 2
                ),
                "the checkpoint at step 15",
                300,
                procs,
                tmp_path,
            )
            for name in list(procs):
                _kill(procs, tmp_path, name)
            killed_at = {name: _records(tmp_path, name)[-1]["step"] for name in procs}
            assert all(3 * EVERY_N < s < MAX_STEPS for s in killed_at.values()), killed_at
            committed = max(e["step"] for e in _events(tmp_path, "g0", "checkpoint_committed"))
            hold.unlink()
            for i in range(2):  # the relaunch: the same ids, the same folders
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address)
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    for name in ("g0", "g1"):
        resumed = _events(tmp_path, name, "resumed")
        assert resumed, f"{name} did not resume from the checkpoint"
        # Both resumed from the newest committed checkpoint (no heal needed: they agree at the first quorum) ...
        after = [r for r in _records(tmp_path, name) if r["pid"] != _records(tmp_path, name)[0]["pid"]]
        # (the newest whose commit event was written, or the one after it whose commit landed as the kill came)
        resumed_from = after[0]["step"] - 1
        assert resumed_from in (committed, committed + EVERY_N) and resumed_from < killed_at[name], (
            after[0],
            committed,
        )
        assert resumed_from == _events(tmp_path, name, "resumed")[-1]["step"]
        assert [e for e in _events(tmp_path, name, "healed") if e["step"] > 0] == [], name  # step 0: the first sync
        # ... and end bitwise equal to the run without a failure.
        assert _same(_weights(tmp_path / name / "final0.pt"), _weights(uninterrupted / name / "final0.pt")), name
    ref = {r["step"]: r for r in _records(uninterrupted, "g0")}
    for record in after:
        assert {k: record[k] for k in STATE} == {k: ref[record["step"]][k] for k in STATE}, record["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_replacement_beside_a_live_quorum_heals_and_reads_no_checkpoint(tmp_path: Path) -> None:
    """Group 0 (the writer) is SIGKILLed; group 1 goes on and writes the checkpoints meanwhile; the replacement for
    group 0 finds checkpoints in the folder but heals from group 1, then writes again (the lowest id)."""
    hold = tmp_path / "hold"
    hold.touch()
    max_steps = 400
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address, max_steps=max_steps)
            _wait(
                lambda: len(_events(tmp_path, "g0", "checkpoint_committed")) >= 2, "2 checkpoints", 300, procs, tmp_path
            )
            _kill(procs, tmp_path, "g0")
            del procs["g0"]
            _wait(
                lambda: len(_events(tmp_path, "g1", "checkpoint_committed")) >= 1,
                "group 1 to write a checkpoint",
                300,
                procs,
                tmp_path,
            )
            procs["g0b"] = _start(tmp_path, "g0b", "0", address, max_steps=max_steps)
            _wait(lambda: len(_records(tmp_path, "g0b")) >= EVERY_N * 2, "the replacement", 300, procs, tmp_path)
            hold.unlink()
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    healed = _events(tmp_path, "g0b", "healed")
    assert len(healed) == 1 and healed[0]["source"] == "1", healed
    assert _events(tmp_path, "g0b", "resumed") == []  # no checkpoint read
    on_disk = max(e["step"] for e in _events(tmp_path, "g1", "checkpoint_committed") if e["time"] < healed[0]["time"])
    first = _records(tmp_path, "g0b")[0]
    assert first["step"] > on_disk
    theirs = {r["step"]: r for r in _records(tmp_path, "g1")}[first["step"]]
    assert {k: first[k] for k in STATE} == {k: theirs[k] for k in STATE}
    # The replacement (the lowest id again) writes the checkpoints after its heal, group 1 no longer does.
    mine = _events(tmp_path, "g0b", "checkpoint_committed")
    assert mine and mine[-1]["step"] == max_steps
    assert all(e["step"] < mine[0]["step"] for e in _events(tmp_path, "g1", "checkpoint_committed"))
    assert json.loads((tmp_path / "g0b" / "done.json").read_text())["global_step"] == max_steps
    assert _same(_weights(tmp_path / "g0b" / "final0.pt"), _weights(tmp_path / "g1" / "final0.pt"))
