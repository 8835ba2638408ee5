"""Periodic health checks under real torchrun: a check fails on one rank mid-run for a real reason (a slowed network
out of one rank, a GPU that reports uncorrected ECC errors through NVML), and every rank acts the same way."""

from __future__ import annotations

import pytest

from lightning_ft.checkpoint.internal import is_committed
from tests.fault._launch import events, output, torchrun

pytestmark = pytest.mark.slow


def _stopped_at(root, step: int, ranks: list[int], proc) -> None:
    """Every rank stopped after committing ``preempt-step=<step>``, with FaultPolicy's exit code."""
    ends = events(root, "attempt_end", 0)
    assert {(e["rank"], e["reason"], e["exit_code"]) for e in ends} == {(r, "stopped", 75) for r in ranks}, output(proc)
    (path,) = {e["checkpoint_path"] for e in ends}
    assert path.endswith(f"preempt-step={step}") and is_committed(path), output(proc)
    assert not (root / "done.json").exists()  # fit did not run to its end


def test_an_ecc_error_on_one_rank_mid_run_checkpoints_and_stops_every_rank_naming_that_rank(tmp_path):
    root = tmp_path / "run"
    proc = torchrun(
        "--root", str(root), "--max-steps", "12", "--ckpt-every", "100", "--health-every", "3",
        "--health-action", "checkpoint_and_stop", "--ecc-at", "1:4",
        "--health-slowdown", "50",  # this test is about NVML: no collective false alarm on a loaded host
    )  # fmt: skip
    assert proc.returncode != 0, output(proc)
    checks = [e for e in events(root, "health_check", 0) if e["periodic"]]
    assert [(e["step"], e["passed"]) for e in checks] == [(3, True)], output(proc)  # before the error: healthy
    (failed,) = events(root, "health_check_failed", 0)
    assert failed["periodic"] is True and failed["step"] == 6 and failed["ranks"] == [1], failed
    assert failed["action"] == "checkpoint_and_stop"
    ((check),) = failed["checks"]
    assert check["rank"] == 1 and check["check"] == "gpu" and "2 uncorrected ECC errors" in check["detail"], check
    _stopped_at(root, 6, [0, 1], proc)
    assert "periodic (step 6) health check failed on 1 of 2 rank(s) [1]" in proc.stderr + proc.stdout, output(proc)


def test_a_slow_network_out_of_one_of_three_ranks_is_named_and_every_rank_checkpoints_and_stops(tmp_path):
    root = tmp_path / "run"
    proc = torchrun(
        "--root", str(root), "--max-steps", "12", "--ckpt-every", "100", "--health-every", "3",
        "--health-action", "checkpoint_and_stop", "--faults", "slow_network:rank=2,ms=300,from_step=4",
        "--health-slowdown", "10",  # above the noise of a loaded host (up to 4.7x), far below 300 ms per message
        nproc=3,
    )  # fmt: skip
    assert proc.returncode != 0, output(proc)
    (failed,) = events(root, "health_check_failed", 0)
    assert failed["periodic"] is True and failed["step"] == 6, failed
    assert failed["ranks"] == [2] and [c["check"] for c in failed["checks"]] == ["collective"], failed
    assert failed["slowdown"]["latency"] > 10.0, failed  # 300 ms added to a round trip of about a millisecond
    assert "every link of this rank is slower" in failed["checks"][0]["detail"], failed
    _stopped_at(root, 6, [0, 1, 2], proc)


def test_with_the_log_action_a_failed_check_is_recorded_and_training_runs_to_its_end(tmp_path):
    root = tmp_path / "run"
    proc = torchrun(
        "--root", str(root), "--max-steps", "8", "--ckpt-every", "100", "--health-every", "2", "--ecc-at", "0:3",
        "--health-slowdown", "50",
    )  # fmt: skip
    assert proc.returncode == 0, output(proc)
    failed = events(root, "health_check_failed", 0)
    assert [(e["step"], e["ranks"], e["action"]) for e in failed] == [(4, [0], "log"), (6, [0], "log"), (8, [0], "log")]
    ends = events(root, "attempt_end", 0)
    assert {(e["rank"], e["reason"]) for e in ends} == {(0, "finished"), (1, "finished")}, output(proc)
