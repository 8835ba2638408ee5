"""A run killed mid-training and started again with the same command ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from lightning_ft.monitors.event_log import read_events
from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow

# 96 samples, 8 per device, 2 ranks: 6 steps per epoch; 14 steps cross two epoch boundaries.
COMMON = ["--max-steps", "14", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(torchrun("--root", str(root), "--out", str(root / "out"), "--ckpt-every", "4", *COMMON))
    return load_run(root / "out")


@pytest.mark.parametrize(
    ("ckpt_every", "kill_at", "resume_step"),
    [
        pytest.param(4, 10, 8, id="mid-epoch"),  # step 8 is batch 2 of epoch 1
        pytest.param(6, 9, 6, id="epoch-boundary"),  # step 6 ends epoch 0
    ],
)
def test_killed_run_resumed_with_same_command_matches_uninterrupted_bitwise(
    tmp_path, uninterrupted, ckpt_every, kill_at, resume_step
):
    args = ["--root", str(tmp_path), "--out", str(tmp_path / "out"), "--ckpt-every", str(ckpt_every), *COMMON]
    killed = torchrun(*args, "--kill-at-step", str(kill_at))
    assert killed.returncode != 0, "the injected hard exit did not happen"
    assert_ok(torchrun(*args))

    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [resume_step]
    weights, losses = load_run(tmp_path / "out")
    ref_weights, ref_losses = uninterrupted
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), f"{name} differs after resume"
    for step in range(resume_step + 1, 15):
        assert losses[step] == ref_losses[step], f"loss at step {step} differs"
