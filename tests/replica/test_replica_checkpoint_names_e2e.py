"""A group that does not write the checkpoints names them as the writer does, with Lightning's default
``ModelCheckpoint(enable_version_counter=True)``: two one-process groups under torchrun share one folder
(``save_top_k=2`` by step, ``save_last=True``, every 5 steps); group 1 waits before each of its saves, so that the
writer's file of the step is already there when it checks whether the name is taken. Each group's
``ModelCheckpoint.state_dict()`` at the end (``best_model_path``, ``last_model_path``, the kept top-k, what a heal
copies) is the writer's. The run: tests/replica/replica_script.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env
from tests.replica._lighthouse import lighthouse
from tests.replica.test_replica_checkpoints_e2e import SCRIPT, _finish, _stop_all

pytest.importorskip("torchft")

MAX_STEPS = 30
EVERY_N = 5


def _start(tmp: Path, name: str, replica_id: str, address: str, **env: str) -> subprocess.Popen:
    env = subprocess_env(TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID=replica_id, NUM_REPLICA_GROUPS="2", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(SCRIPT), "--out", str(tmp / name), "--max-steps", str(MAX_STEPS)]
    cmd += ["--ckpt-dir", str(tmp / "ckpt"), "--every-n", str(EVERY_N), "--top-k", "2", "--monitor-step"]
    cmd += ["--save-last"]
    log = open(tmp / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_group_names_its_checkpoints_as_the_writer_with_the_version_counter_on(tmp_path: Path) -> None:
    procs: dict[str, subprocess.Popen] = {}
    try:
        with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=500) as address:
            procs["g0"] = _start(tmp_path, "g0", "0", address)  # the writer (the lowest id) throughout
            procs["g1"] = _start(tmp_path, "g1", "1", address, REPLICA_TEST_SAVE_DELAY_S="0.5")
            _finish(procs, tmp_path)
    finally:
        _stop_all(procs)

    writer = json.loads((tmp_path / "g0" / "checkpoint_state.json").read_text())
    other = json.loads((tmp_path / "g1" / "checkpoint_state.json").read_text())
    assert other == writer
    ckpt = tmp_path / "ckpt"
    kept = [f"epoch=0-step={s}.ckpt" for s in (MAX_STEPS - EVERY_N, MAX_STEPS)]
    assert sorted(Path(p).name for p in writer["best_k_models"]) == kept
    assert Path(writer["best_model_path"]).name == kept[-1]
    assert Path(writer["last_model_path"]) == ckpt / "last.ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix == ".ckpt") == sorted([*kept, "last.ckpt"])
