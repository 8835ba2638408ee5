"""A run killed mid-training and started again with the same command ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from lightning_ft.events import read_events
from tests.e2e._torchrun import assert_ok, load_run, torchrun

pytestmark = pytest.mark.slow

# 96 samples, 8 per device, 2 data-parallel ranks: 6 steps per epoch; 14 steps cross two epoch boundaries.
COMMON = ["--max-steps", "14", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runs = {}

    def get(tp: int):
        if tp not in runs:
            root = tmp_path_factory.mktemp(f"uninterrupted-tp{tp}")
            args = ["--root", str(root), "--out", str(root / "out"), "--ckpt-every", "4", "--tp", str(tp)]
            assert_ok(torchrun(*args, *COMMON))
            runs[tp] = load_run(root / "out")
        return runs[tp]

    return get


@pytest.mark.parametrize(
    ("tp", "ckpt_every", "kill_at", "resume_step", "fmt"),
    [
        # The default ("auto"): both ranks write one checkpoint file; each rank's RNG comes from its record.
        pytest.param(1, 4, 10, 8, "auto", id="ddp-mid-epoch"),  # step 8 is batch 2 of epoch 1
        pytest.param(1, 6, 9, 6, "auto", id="ddp-epoch-boundary"),  # step 6 ends epoch 0
        # The same state in torchsnapshot folders (sharded across the ranks).
        pytest.param(1, 4, 10, 8, "torchsnapshot", id="ddp-mid-epoch-torchsnapshot"),
        # Tensor parallel x FSDP2 as in Lightning's example: DTensor shards with _StridedShard placements ("auto":
        # folders).
        pytest.param(2, 4, 10, 8, "auto", id="fsdp2-tp-mid-epoch"),
    ],
)
def test_killed_run_resumed_with_same_command_matches_uninterrupted_bitwise(
    tmp_path, uninterrupted, tp, ckpt_every, kill_at, resume_step, fmt
):
    args = ["--root", str(tmp_path), "--out", str(tmp_path / "out"), "--ckpt-every", str(ckpt_every)]
    args += ["--tp", str(tp), "--checkpoint-format", fmt, *COMMON]
    killed = torchrun(*args, "--kill-at-step", str(kill_at))
    assert killed.returncode != 0, "the injected hard exit did not happen"
    assert_ok(torchrun(*args))

    resumed = [e for e in read_events(tmp_path) if e["event"] == "resumed"]
    assert [e["step"] for e in resumed] == [resume_step]
    # The epoch in the name depends on the data-parallel size (tensor parallel halves it): find it by its step.
    [saved] = (tmp_path / "ckpt").glob(f"epoch=*-step={resume_step}.ckpt")
    as_file = (fmt, tp) == ("auto", 1)  # "auto": the file for data-parallel state, folders for DTensor state
    assert saved.is_file() if as_file else saved.is_dir()
    said = "torch.save files" if as_file else "torchsnapshot folders"
    assert f"lightning-ft: checkpoints are {said}" in killed.stdout + killed.stderr
    weights, losses = load_run(tmp_path / "out")
    ref_weights, ref_losses = uninterrupted(tp)
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), f"{name} differs after resume"
    for step in range(resume_step + 1, 15):
        assert losses[step] == ref_losses[step], f"loss at step {step} differs"
