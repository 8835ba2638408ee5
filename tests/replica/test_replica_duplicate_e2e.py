"""One replica id, one live process, under real torchrun (two one-process groups sharing a checkpoint folder):

- a second torchrun launched with a live group's ``REPLICA_GROUP_ID`` refuses before it joins any quorum, with an error
  that names the id and the other process; the two groups never see it and train on;
- a SIGKILL of a group's torchrun agent alone (its worker lives on: torchrun starts workers in their own session)
  makes the worker stop by itself within a second or so, saying why; a replacement with the same id then heals from
  the other group and trains, and the other group never restarts.

The run: tests/replica/replica_script.py (see tests/replica/test_replica_checkpoints_e2e.py). Times are never asserted.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_checkpoints_e2e import _events, _finish, _start, _stop_all
from tests.replica.test_replica_groups_e2e import _log, _records, _wait

pytest.importorskip("torchft")

MAX_STEPS = 1000


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie left to a parent that does not reap counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_live_groups_id_is_refused_and_a_killed_torchruns_worker_stops_for_its_replacement(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            for i in range(2):
                procs[f"g{i}"] = _start(tmp_path, f"g{i}", str(i), address, max_steps=MAX_STEPS)
            _wait(
                lambda: all(len(_records(tmp_path, f"g{i}")) >= 5 for i in range(2)), "2 groups", 300, procs, tmp_path
            )

            # A second launch with group 0's id: refused before it joins a quorum; groups 0 and 1 train on.
            second = _start(tmp_path, "g0_second", "0", address, max_steps=MAX_STEPS)
            assert second.wait(timeout=300) != 0, _log(tmp_path, "g0_second")
            said = _log(tmp_path, "g0_second")
            assert "REPLICA_GROUP_ID=0 is taken by a live process (torchft id 0:" in said, said
            assert "manager " in said and "at step " in said, said
            assert f"pid {_records(tmp_path, 'g0')[-1]['pid']} on host " in said, said  # the process to stop
            assert not (tmp_path / "g0_second" / "steps.jsonl").exists()

            # SIGKILL of group 0's torchrun agent only: its worker notices and stops by itself.
            orphan = _records(tmp_path, "g0")[-1]["pid"]
            assert not _gone(orphan)
            procs["g0"].kill()
            procs["g0"].wait(timeout=60)
            del procs["g0"]
            killed = time.monotonic()
            while not _gone(orphan):
                assert time.monotonic() < killed + 120, f"the worker {orphan} of a SIGKILLed torchrun goes on training"
                time.sleep(0.05)
            print(f"the orphan stopped {time.monotonic() - killed:.2f} s after its agent's SIGKILL")
            assert not (tmp_path / "g0" / "done.json").exists(), "the orphan trained to the end"
            said = _log(tmp_path, "g0")
            assert "this worker's torchrun agent (pid" in said and "REPLICA_GROUP_ID=0" in said, said
            assert [e["replica_id"] for e in _events(tmp_path, "g0", "replica_orphaned")] == ["0"]

            # Its replacement, with the same id, starts beside group 1, heals from it and trains.
            procs["g0b"] = _start(tmp_path, "g0b", "0", address, max_steps=MAX_STEPS)
            _wait(lambda: len(_records(tmp_path, "g0b")) >= 3, "the replacement to commit steps", 300, procs, tmp_path)
            hold.unlink()
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    # Group 1 never restarted, never saw a second process with an id, and never more than two groups.
    assert len({r["pid"] for r in _records(tmp_path, "g1")}) == 1
    for name in ("g1", "g0b"):
        assert _events(tmp_path, name, "replica_duplicate") == [], name
        assert max(e["live_groups"] for e in _events(tmp_path, name, "replica_quorum")) <= 2, name
    assert [e["source"] for e in _events(tmp_path, "g0b", "healed") if e["step"] > 0] == ["1"]
    ends = {name: _records(tmp_path, name)[-1] for name in ("g1", "g0b")}
    assert ends["g1"]["step"] == ends["g0b"]["step"] == MAX_STEPS
    assert ends["g1"]["weights"] == ends["g0b"]["weights"]
