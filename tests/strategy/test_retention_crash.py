"""A crash while a top-k checkpoint's replacement is being written leaves what ``DDPStrategy`` leaves: a ``last.ckpt``
whose ``ModelCheckpoint`` state names a best checkpoint that exists.

Found with pytorch-tabular (``ModelCheckpoint(monitor="valid_loss", save_top_k=1)`` plus ``save_last=True``), killed
at 2 ranks: Lightning asks for the new top-k file and then deletes the old one; lightning-ft deleted it at once
(only the newest committed checkpoint, ``last.ckpt``, was protected), the kill came before the new file committed,
and the resume from ``last.ckpt`` restored a ``best_model_path`` that no longer existed (``load_best`` /
``trainer.test(ckpt_path="best")`` fail on it when no later epoch improves). The deletion now waits for the commit of
the save in flight, as Lightning's synchronous save has written the replacement before it deletes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO_ROOT, subprocess_env

SCRIPT = Path(__file__).with_name("retention_crash_script.py")


def _crash(root: Path, strategy: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--strategy", strategy, "--root", str(root)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    dirpath = root / "ckpt"
    last = torch.load(dirpath / "last.ckpt", weights_only=True)
    (state,) = (v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    best = Path(state["best_model_path"])
    return {
        "last_step": last["global_step"],
        "best": best.name,
        "best_exists": best.is_file(),
        "best_step": torch.load(best, weights_only=True)["global_step"] if best.is_file() else None,
    }


@pytest.mark.slow
def test_a_crash_before_the_replacing_top_k_save_commits_keeps_the_best_that_last_names(tmp_path):
    ddp = _crash(tmp_path / "ddp", "ddp")
    elastic = _crash(tmp_path / "elastic", "elastic")
    # DDPStrategy wrote step 4's files before the kill; lightning-ft's were in flight: last.ckpt is step 2's.
    assert ddp == {"last_step": 4, "best": "epoch=0-step=4.ckpt", "best_exists": True, "best_step": 4}
    assert elastic == {"last_step": 2, "best": "epoch=0-step=2.ckpt", "best_exists": True, "best_step": 2}
