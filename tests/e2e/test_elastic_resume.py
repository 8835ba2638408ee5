"""A run saved on two ranks resumes on one, keeping the global batch through gradient accumulation."""

from __future__ import annotations

import json

import pytest

from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.extended
def test_run_saved_on_two_ranks_resumes_on_one_with_doubled_accumulation(tmp_path):
    args = ["--root", str(tmp_path), "--ckpt-every", "4"]
    assert_ok(torchrun(*args, "--out", str(tmp_path / "out2"), "--max-steps", "8", nproc=2))
    assert_ok(torchrun(*args, "--out", str(tmp_path / "out1"), "--max-steps", "12", nproc=1))
    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert len(resumed) == 1
    event = resumed[0]
    assert (event["step"], event["saved_world_size"], event["world_size"]) == (8, 2, 1)
    assert event["accumulate_grad_batches"] == 2 and event["lr_scale"] == 1.0
    _, losses = load_run(tmp_path / "out1")
    # Recorded per micro-batch at the step count after it: the first micro-batch after the resume still reads step 8.
    assert sorted(losses) == list(range(8, 13))


def test_keep_local_resume_on_fewer_ranks_ramps_the_learning_rate_down_linearly(tmp_path):
    args = ["--root", str(tmp_path), "--ckpt-every", "4", "--batch-policy", "keep_local", "--lr-warmup", "2"]
    assert_ok(torchrun(*args, "--out", str(tmp_path / "out2"), "--max-steps", "4", nproc=2))
    assert_ok(torchrun(*args, "--out", str(tmp_path / "out1"), "--max-steps", "8", nproc=1))
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert event["accumulate_grad_batches"] == 1 and event["lr_scale"] == 0.5  # global batch 16 -> 8
    lrs = {int(k): v for k, v in json.loads((tmp_path / "out1" / "lrs.json").read_text()).items()}
    base = 3e-3  # examples.gpt.GPT's default
    assert lrs == pytest.approx({5: base, 6: 0.75 * base, 7: 0.5 * base, 8: 0.5 * base})
