"""Auto-resume resumes this run only, under real torchrun (2 processes) and with two runs started at once from one
folder (issue 30, cases C and D): ``DDPStrategy`` running the same script is the oracle. The one-process cases are in
tests/strategy/test_auto_resume_identity.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ft.events import concurrent_runs, read_events
from tests.e2e._torchrun import assert_bitwise_equal, assert_ok, rank_weights
from tests.e2e._torchrun import torchrun as _torchrun
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("resume_identity_script.py")


def torchrun(root: Path, *args: str, max_restarts: int = 0, env: dict[str, str] | None = None):
    return _torchrun("--root", str(root), *args, max_restarts=max_restarts, timeout=300, script=SCRIPT, env=env)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_another_model_in_the_same_checkpoint_folder_under_torchrun_trains_from_scratch_and_restarts_on_its_own(
    tmp_path,
):
    """(D) at 2 processes: experiment 2 (a wider layer, the same checkpoint folder) trains from scratch after one
    message naming experiment 1's checkpoint; it crashes after step 3 and torchrun's restart resumes its own step-2
    checkpoint, not experiment 1's step 8; it ends bitwise where DDPStrategy's uninterrupted experiment 2 ends, and
    experiment 1's files are as they were."""
    root, ckpt = tmp_path / "ft", tmp_path / "ft" / "ckpt"
    assert_ok(torchrun(root, "--ckpt", str(ckpt), "--out", str(root / "out1"), "--hidden", "16"))
    before = files(ckpt)
    second = torchrun(
        root, "--ckpt", str(ckpt), "--out", str(root / "out2"), "--hidden", "32", "--crash-at", "3", max_restarts=1
    )
    assert_ok(second)
    output = second.stdout + second.stderr
    # One message per attempt that met experiment 1's checkpoints (the first, and the restart), each naming its newest.
    assert output.count("not this run's checkpoint") == 2, output[-5000:]
    assert "epoch=0-step=8.ckpt" in output and "auto_resume=False" in output and "ckpt_path=" in output
    after = files(ckpt)
    assert all(after.get(name) == data for name, data in before.items())
    resumed = [e for e in read_events(root) if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [2] and "-v1" in resumed[0]["path"]
    oracle = tmp_path / "ddp"
    assert_ok(
        torchrun(
            oracle, "--ckpt", str(oracle / "ckpt"), "--out", str(oracle / "out"), "--hidden", "32", "--strategy", "ddp"
        )
    )
    assert_bitwise_equal(rank_weights(root / "out2"), rank_weights(oracle / "out"))


def test_another_experiment_with_a_new_checkpoint_folder_under_torchrun_never_restores_the_first_ones_memory_copy(
    tmp_path,
):
    """(C) at 2 processes: experiment A (memory tier every 2 steps) crashes after step 5; experiment B, from the same
    working folder with a new checkpoint folder and another lr, is another run (its own run id and event log, attempt
    0) and trains from scratch (bitwise DDPStrategy's B); A's restart is A's attempt 1 and still resumes its own
    step-4 memory copy."""
    root = tmp_path / "ft"
    env = {"LIGHTNING_FT_MEMORY_DIR": str(tmp_path / "shm")}
    a = ("--ckpt", str(root / "ckpt-a"), "--ckpt-every", "100", "--memory-every", "2", "--lr", "0.1")
    crashed = torchrun(root, *a, "--out", str(root / "out-a"), "--crash-at", "5", env=env)
    assert crashed.returncode != 0 and "crash at step 5" in crashed.stderr
    b = ("--ckpt", str(root / "ckpt-b"), "--ckpt-every", "100", "--memory-every", "2", "--lr", "0.05")
    a_log = files(root / "lightning-ft" / "events")
    assert_ok(torchrun(root, *b, "--out", str(root / "out-b"), env=env))
    assert files(root / "lightning-ft" / "events") == a_log  # B is another run: its own event log
    (b_folder,) = concurrent_runs(root)
    b_events = read_events(b_folder)
    assert {(e["run_id"], e["attempt"]) for e in b_events} == {(b_folder.name, 0)}
    assert b_folder.name not in {e["run_id"] for e in read_events(root)}
    assert not [e for e in read_events(root) + b_events if e["event"] == "resumed"]
    oracle = tmp_path / "ddp"
    assert_ok(
        torchrun(
            oracle, "--ckpt", str(oracle / "ckpt-b"), "--lr", "0.05", "--out", str(oracle / "out"), "--strategy", "ddp"
        )
    )
    assert_bitwise_equal(rank_weights(root / "out-b"), rank_weights(oracle / "out"))
    assert_ok(torchrun(root, *a, "--out", str(root / "out-a"), env=env))
    a_events = read_events(root)
    resumed = [e for e in a_events if e["event"] == "resumed"]
    assert [(e["step"], e["tier"]) for e in resumed] == [(4, "local")]
    assert sorted({e["attempt"] for e in a_events}) == [0, 1] and len({e["run_id"] for e in a_events}) == 1


def _python(root: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        cwd=REPO_ROOT,
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_runs_started_at_once_from_one_folder_share_neither_a_memory_copy_nor_an_event_log(tmp_path):
    """A sweep: run 1 holds after step 3 while run 2 (another checkpoint folder, another lr) runs start to end from the
    same working folder. Run 2 gets its own run id and event log (lightning-ft/runs/<id>/events), its memory copies
    are its own, and neither resumes anything; run 2 relaunched while run 1 still lives is run 2's attempt 1;
    ``lightning-ft report`` names the second run."""
    root, hold = tmp_path / "sweep", tmp_path / "hold"
    hold.write_text("")
    env = {"LIGHTNING_FT_MEMORY_DIR": str(tmp_path / "shm")}
    common = ("--memory-every", "2", "--ckpt-every", "100", "--max-steps", "6")
    first = _python(
        root,
        "--ckpt",
        str(root / "ckpt-1"),
        "--out",
        str(root / "out1"),
        *common,
        "--lr",
        "0.1",
        "--hold-file",
        str(hold),
        "--hold-step",
        "3",  # the memory tier copies after every other callback: step 2's copy is there before the hold at 3
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not any((tmp_path / "shm").glob("lightning-ft/*/rank0/step=2")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.2)
        second = _python(
            root, "--ckpt", str(root / "ckpt-2"), "--out", str(root / "out2"), *common, "--lr", "0.05", env=env
        )
        out2, _ = second.communicate(timeout=240)
        assert second.returncode == 0, out2[-5000:]
        # Run 2 relaunched (a crash restart, a requeue) while run 1 still lives: run 2's next attempt, not a new run.
        again = _python(
            root, "--ckpt", str(root / "ckpt-2"), "--out", str(root / "out2"), *common, "--lr", "0.05", env=env
        )
        out2_again, _ = again.communicate(timeout=240)
        assert again.returncode == 0, out2_again[-5000:]
    finally:
        hold.unlink()
    out1, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out1[-5000:]
    own = read_events(root)
    (other,) = concurrent_runs(root)
    theirs = read_events(other)
    assert {e["run_id"] for e in own} != {e["run_id"] for e in theirs}
    assert len({e["run_id"] for e in own}) == len({e["run_id"] for e in theirs}) == 1
    assert other.name == theirs[0]["run_id"]
    assert sorted({e["attempt"] for e in theirs}) == [0, 1] and {e["attempt"] for e in own} == {0}
    assert not [e for e in own + theirs if e["event"] == "resumed" and e["attempt"] == 0]
    memory = [Path(e["path"]).parents[1] for e in own + theirs if e["event"] == "checkpoint_committed"]
    assert len(set(memory)) == 2  # one memory folder per run
    assert "keeps its event log in" in out2 and "another run, or another replica group" in out2
    report = subprocess.run(
        [sys.executable, "-m", "lightning_ft.cli", "report", str(root)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert str(other) in report.stdout
