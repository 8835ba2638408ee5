"""After a fallback, Lightning's own lines and ``trainer.ckpt_path`` name the checkpoint that was loaded (issue 37,
item 7): ``DDPStrategy`` resuming that checkpoint by its path is the oracle.

A run writes steps 3, 6 and 9 (one epoch each) and stops; its newest file is then cut short. The relaunch (a new
process: a restart) skips it, says so, and resumes step 6: "Restored all states from the checkpoint at ..." and
``trainer.ckpt_path`` name step 6, as under ``DDPStrategy`` given that file, and it ends with DDPStrategy's weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e._torchrun import assert_bitwise_equal, assert_ok, rank_weights
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("resume_identity_script.py")
EPOCHS_OF_THREE_STEPS = ("--samples", "12", "--ckpt-every", "3")


def python(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *EPOCHS_OF_THREE_STEPS, *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def restored_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "Restored all states" in line]


def test_a_fallback_is_named_in_lightnings_restored_line_and_trainer_ckpt_path_as_under_ddp_strategy(tmp_path):
    root, ckpt = tmp_path / "ft", tmp_path / "ft" / "ckpt"
    assert_ok(python(root, "--ckpt", str(ckpt), "--out", str(root / "out1"), "--max-steps", "9"))
    newest = ckpt / "epoch=2-step=9.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a copy cut short, a damaged disk
    resumed = python(root, "--ckpt", str(ckpt), "--out", str(root / "out2"), "--max-steps", "12")
    assert_ok(resumed)
    output = resumed.stdout + resumed.stderr
    assert f"Skipping checkpoint {newest}" in output
    fallback = ckpt / "epoch=1-step=6.ckpt"
    assert restored_lines(resumed) == [f"Restored all states from the checkpoint at {fallback}"]
    assert json.loads((root / "out2" / "run.json").read_text()) == {"ckpt_path": str(fallback), "step": 12}

    oracle = tmp_path / "ddp"  # DDPStrategy resumes the same step-6 file, given by its path
    given = oracle / "ckpt" / fallback.name
    given.parent.mkdir(parents=True)
    shutil.copyfile(fallback, given)
    ddp = python(
        oracle,
        "--strategy",
        "ddp",
        *("--ckpt", str(oracle / "ckpt"), "--out", str(oracle / "o2"), "--max-steps", "12", "--ckpt-path", str(given)),
    )
    assert_ok(ddp)
    assert restored_lines(ddp) == [f"Restored all states from the checkpoint at {given}"]
    assert json.loads((oracle / "o2" / "run.json").read_text()) == {"ckpt_path": str(given), "step": 12}
    assert_bitwise_equal(rank_weights(root / "out2"), rank_weights(oracle / "o2"))
