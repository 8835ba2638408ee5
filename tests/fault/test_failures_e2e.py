"""Crashes under real torchrun: a hung rank, a full disk, a corrupted shard, SIGKILL at random points (mid-write
included), an unwritable checkpoint folder. After each, nothing committed is lost and the run resumes from the newest
valid checkpoint."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint import verify
from lightning_ft.checkpoint.internal import is_committed
from lightning_ft.fault.internal import HANG_EXIT_CODE
from tests.fault._launch import events, output, torchrun

pytestmark = pytest.mark.slow


def _committed_paths(root: Path) -> list[str]:
    return sorted({e["path"] for e in events(root, "checkpoint_committed")})


def _largest_shard(checkpoint: Path) -> Path:
    if checkpoint.is_file():  # the default at any process count: the one torch.save file both ranks wrote
        return checkpoint
    files = [p for p in checkpoint.rglob("*") if p.is_file() and not p.name.startswith(".") and p.suffix != ".json"]
    return max(files, key=lambda p: p.stat().st_size)


def test_a_hung_rank_a_full_disk_and_a_corrupted_shard_each_end_in_a_resume_from_the_newest_valid_checkpoint(tmp_path):
    root = tmp_path / "run"
    faults = "hang_at:rank=1,step=3,where=data,attempt=0;storage_error_at:rank=0,step=4,errno=ENOSPC,attempt=1"
    proc = torchrun(
        "--root", str(root), "--max-steps", "8", "--faults", faults,
        "--hang-timeout", "10", "--first-step-timeout", "120",
        max_restarts=2,
    )  # fmt: skip
    assert proc.returncode == 0, output(proc)

    # Attempt 0: rank 1 sleeps in a data read after step 3; rank 0 waits for it in the all-reduce of step 4.
    hangs = events(root, "hang", 0)
    assert hangs and all(e["ranks"] == [1] and e["first_rank"] == 1 for e in hangs), hangs
    assert all(e["idle_s"] >= 10.0 and e["heartbeats"]["1"]["point"] == "batch_end" for e in hangs)
    own = [e for e in hangs if e["rank"] == 1]
    if own:  # rank 1's own stacks show where it stopped
        assert "_on_data_read" in Path(own[0]["stacks_path"]).read_text()
    assert {e["reason"] for e in events(root, "attempt_end", 0)} <= {"hung", "crashed"}
    assert any(e["reason"] == "hung" and e["exit_code"] == HANG_EXIT_CODE for e in events(root, "attempt_end", 0))
    (resumed1,) = events(root, "resumed", 1)
    assert resumed1["step"] == 2  # the newest checkpoint committed before the hang

    # Attempt 1: the save of step 4 finds the disk full on rank 0; the run stops at the next save.
    ends = events(root, "attempt_end", 1)
    assert {e["reason"] for e in ends} == {"crashed"} and any("No space left" in e["error"] for e in ends), ends
    (resumed2,) = events(root, "resumed", 2)
    assert resumed2["step"] == 2  # step 4 never committed; nothing committed was lost
    assert json.loads((root / "done.json").read_text())["step"] == 8
    committed = _committed_paths(root)
    assert all(is_committed(p) and verify(p) == [] for p in committed)

    # A truncated shard in the newest checkpoint: the next launch falls back to the one before.
    newest = root / "ckpt" / "epoch=0-step=8.ckpt"
    shard = _largest_shard(newest)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    again = torchrun("--root", str(root), "--max-steps", "10")
    assert again.returncode == 0, output(again)
    (rejected,) = events(root, "checkpoint_rejected", 3)
    assert rejected["path"] == str(newest)
    (resumed3,) = events(root, "resumed", 3)
    assert resumed3["step"] == 6
    assert json.loads((root / "done.json").read_text())["step"] == 10


def _kill_plan(seed: int, trials: int) -> tuple[str, int, list[int]]:
    rng = random.Random(seed)
    faults, kill_steps, step = [], [], 0
    for attempt in range(trials):
        step += rng.randint(2, 3)
        rank = rng.randint(0, 1)
        if rng.random() < 0.5:
            step += step % 2  # checkpoints are written at even steps
            delay = rng.choice([0.0, 0.01, 0.05])
            faults.append(f"kill_at:rank={rank},step={step},during=write,delay_s={delay},attempt={attempt}")
        else:
            faults.append(f"kill_at:rank={rank},step={step},attempt={attempt}")
        kill_steps.append(step)
    return ";".join(faults), step + 2, kill_steps


@pytest.mark.extended
@pytest.mark.parametrize("seed", [20240])
def test_sigkill_of_one_rank_at_random_points_never_loses_a_committed_checkpoint(tmp_path, seed):
    trials = 5
    faults, max_steps, kill_steps = _kill_plan(seed, trials)
    root = tmp_path / "run"
    proc = torchrun("--root", str(root), "--max-steps", str(max_steps), "--faults", faults, max_restarts=trials)
    assert proc.returncode == 0, f"plan {faults}\n" + output(proc)
    assert proc.stdout.count("[fault] SIGKILL") == trials
    for attempt in range(trials):
        start = min(e["time"] for e in events(root, "attempt_start", attempt + 1))
        before = [e["step"] for e in events(root, "checkpoint_committed") if e["time"] < start]
        (resumed,) = events(root, "resumed", attempt + 1)
        # The newest checkpoint whose commit was recorded, or a newer one whose marker made it just before the kill.
        assert max(before) <= resumed["step"] <= kill_steps[attempt], (faults, attempt, before, resumed)
        assert is_committed(resumed["path"])
    committed = _committed_paths(root)
    assert all(is_committed(p) and verify(p) == [] for p in committed)
    leftovers = [p for p in (root / "ckpt").iterdir() if not is_committed(p)]
    assert leftovers == []  # half-written saves of the killed attempts were cleaned up
    assert json.loads((root / "done.json").read_text())["step"] == max_steps


@pytest.mark.extended
@pytest.mark.parametrize(("nproc", "rank"), [(1, 0), (2, 1)])  # 2: both ranks write the file; rank 1 is killed
def test_sigkill_during_the_write_of_a_checkpoint_file_keeps_the_previous_file_and_the_resume_is_exact(
    tmp_path, nproc, rank
):
    args = ("--max-steps", "8", "--checkpoint-format", "file", "--no-health-checks")
    uninterrupted = torchrun("--root", str(tmp_path / "whole"), *args, nproc=nproc)
    assert uninterrupted.returncode == 0, output(uninterrupted)
    root = tmp_path / "killed"
    faults = f"kill_at:rank={rank},step=6,during=write,delay_s=0.0,attempt=0"
    proc = torchrun("--root", str(root), *args, "--faults", faults, nproc=nproc, max_restarts=1)
    assert proc.returncode == 0, output(proc)
    assert proc.stdout.count("[fault] SIGKILL") == 1
    assert [e["step"] for e in events(root, "checkpoint_committed", 0)] == [2, 4]
    (resumed,) = events(root, "resumed", 1)
    assert resumed["step"] == 4 and Path(resumed["path"]).is_file()  # the file of step 4, untouched by the kill
    files = sorted(p.name for p in (root / "ckpt").iterdir())
    assert files == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)]  # the half-written save was cleaned up
    assert all(is_committed(root / "ckpt" / name) and verify(root / "ckpt" / name) == [] for name in files)
    expected = torch.load(tmp_path / "whole" / "final_weights.pt", weights_only=True)
    actual = torch.load(root / "final_weights.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "the resumed run is not the uninterrupted one"


def test_an_unwritable_checkpoint_folder_stops_every_rank_before_training_with_one_report(tmp_path):
    root = tmp_path / "run"
    proc = torchrun("--root", str(root), "--ckpt-dir", "/sys/lightning_ft_ckpt")
    assert proc.returncode != 0
    assert "pre-flight health check failed on 2 of 2 rank(s) [0, 1]" in proc.stderr, output(proc)
    assert "rank 0 checkpoint_dir" in proc.stderr and "rank 1 checkpoint_dir" in proc.stderr
    assert events(root, "first_step") == []
    (failed,) = events(root, "health_check_failed")
    assert sorted(c["rank"] for c in failed["checks"]) == [0, 1]


def test_the_survivor_of_a_killed_peer_says_in_one_line_that_the_peer_failed_and_which_checkpoint_is_committed(
    tmp_path,
):
    # Rank 0's write of the step-4 checkpoint stalls, so that save is still in flight when rank 1 is SIGKILLed in
    # step 5: rank 0's step fails in the all-reduce (the run's error, as under DDPStrategy) and its teardown finds the
    # save failed too, for the same reason.
    root = tmp_path / "run"
    faults = "storage_stall_at:rank=0,step=4,seconds=10;kill_at:rank=1,step=5"
    proc = torchrun("--root", str(root), "--max-steps", "8", "--no-health-checks", "--faults", faults)
    assert proc.returncode != 0 and "[fault] SIGKILL (step) at rank 1, step 5" in proc.stdout, output(proc)
    err = proc.stderr
    assert "teardown failed" not in err, output(proc)
    assert "During handling of the above exception, another exception occurred" not in err, output(proc)
    lines = [line for line in err.splitlines() if "lightning-ft: rank 0 lost a peer" in line]
    assert len(lines) == 1, output(proc)
    ckpt = root / "ckpt"
    assert lines[0].startswith("lightning-ft: rank 0 lost a peer (connection ") and "by rank 1" in lines[0], lines
    in_flight, committed = ckpt / "epoch=0-step=4.ckpt", ckpt / "epoch=0-step=2.ckpt"
    assert (
        f"while waiting for the checkpoint in flight; the checkpoint in flight, {in_flight} (step 4),"
        f" is not committed; the last committed checkpoint is {committed} (step 2)." in lines[0]
    ), lines
    assert "Expected when another process of the run dies" in lines[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=2.ckpt"]
