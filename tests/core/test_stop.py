"""Checkpoint-and-stop (lightning_ft/stop.py): how an attempt's end is recorded."""

from __future__ import annotations

from pathlib import Path

from lightning_ft.stop import CheckpointedStop, attempt_end_fields


def test_attempt_end_says_how_the_attempt_ended():
    assert attempt_end_fields(None) == {"reason": "finished", "exit_code": 0}
    stop = CheckpointedStop(75, reason="preempted", checkpoint_path=Path("/c/preempt-step=4"))
    assert attempt_end_fields(stop) == {
        "reason": "preempted",
        "exit_code": 75,
        "checkpoint_path": "/c/preempt-step=4",
    }
    crashed = attempt_end_fields(OSError(28, "No space left on device"))
    assert crashed["reason"] == "crashed" and "No space left" in crashed["error"] and crashed["exit_code"] is None
