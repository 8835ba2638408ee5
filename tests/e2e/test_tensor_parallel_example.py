"""Lightning's tensor-parallel example, saved at dp2 x tp2 and relaunched at dp1 x tp2 under torchrun, resumes with
the saved weights (issue 37, item 1).

The example wraps every block in ``checkpoint_wrapper`` and FSDP2 only with more than one data-parallel rank, so the
parameter paths differ between the two launches; the checkpoint's state dict names do not. The script and the
example's files: tests/e2e/tensor_parallel_script.py. The identity rules themselves, at every layout in one process:
tests/strategy/test_identity_across_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e._torchrun import assert_ok, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("tensor_parallel_script.py")


def launch(tmp_path: Path, dp: int, tp: int, out: str, max_steps: int):
    args = ("--dp", str(dp), "--tp", str(tp), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / out))
    return torchrun(
        *args, "--max-steps", str(max_steps), "--root", str(tmp_path), nproc=dp * tp, script=SCRIPT, timeout=400
    )


def test_lightnings_tensor_parallel_example_saved_at_dp2_tp2_resumes_at_dp1_tp2_with_the_saved_weights(tmp_path):
    assert_ok(launch(tmp_path, 2, 2, "first", max_steps=4))
    saved = torch.load(tmp_path / "first" / "end.pt", weights_only=True)  # the state of the step-4 checkpoint
    relaunch = launch(tmp_path, 1, 2, "second", max_steps=6)
    assert_ok(relaunch)
    output = relaunch.stdout + relaunch.stderr
    assert "not this run's checkpoint" not in output and "Training starts from scratch" not in output
    assert f"Restored all states from the checkpoint at {tmp_path / 'ckpt' / 'epoch=0-step=4.ckpt'}" in output
    assert json.loads((tmp_path / "second" / "start.json").read_text()) == {"step": 4}
    restored = torch.load(tmp_path / "second" / "start.pt", weights_only=True)
    assert restored.keys() == saved.keys()
    for name in saved:
        assert torch.equal(restored[name], saved[name]), name
