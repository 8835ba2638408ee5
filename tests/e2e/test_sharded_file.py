"""Tensor-parallel state whose shards are rows (``Shard(0)``, plain tensors) is checkpointed as Lightning's file.

Under ``ElasticFT3D(tensor_parallel_size=2)`` at 2 processes (``checkpoint_format="file"``, or the default
``"auto"``): the checkpoint at the path Lightning asks for is one ``torch.save`` file of full tensors, which ``torch.load(weights_only=True)`` and
``load_from_checkpoint`` read in a process that never imported lightning-ft; a run killed after a save and started again
ends bitwise equal to an uninterrupted one. State a file cannot hold (a row-parallel head: ``Shard(1)``) is refused
under ``"file"`` naming the tensor and its placement, and written as folders under ``"auto"``, said once.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e._torchrun import assert_bitwise_equal, assert_ok, rank_weights, torchrun
from tests.helpers import REPO_ROOT, subprocess_env

SCRIPT = Path(__file__).with_name("sharded_file_script.py")

pytestmark = pytest.mark.slow


def _run(root, *args):
    return torchrun("--root", str(root), "--out", str(root / "out"), *args, script=SCRIPT, timeout=400)


def test_killed_tensor_parallel_run_resumes_bitwise_from_the_file_that_lightning_loads(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    assert_ok(_run(uninterrupted))
    killed = tmp_path / "killed"
    # The killed run under the default "auto" (the uninterrupted one under "file"): row shards get the file there too.
    first = _run(killed, "--checkpoint-format", "auto", "--kill-at-step", "5")
    assert first.returncode != 0, "the injected hard exit did not happen"
    said = (
        "lightning-ft: checkpoints are torch.save files, the file Lightning writes, written by all 2 ranks in parallel"
    )
    assert (first.stdout + first.stderr).count(said) == 1, first.stdout + first.stderr
    saved = killed / "ckpt" / "epoch=0-step=4.ckpt"
    assert saved.is_file(), "the checkpoint of tensor-parallel state is one file at the path Lightning asked for"
    with zipfile.ZipFile(saved) as archive:
        assert archive.testzip() is None
    # A process that never imported lightning-ft: torch.load(weights_only=True) and Lightning's load_from_checkpoint.
    script = (
        "import sys, torch\n"
        "from tests.e2e.sharded_file_model import RowShardedNet\n"
        f"d = torch.load({str(saved)!r}, weights_only=True)\n"
        f"m = RowShardedNet.load_from_checkpoint({str(saved)!r})\n"
        "assert 'lightning_ft' not in sys.modules\n"
        "assert {k: tuple(v.shape) for k, v in d['state_dict'].items()} == {'embed.weight': (17, 8),"
        " 'proj.weight': (6, 8), 'proj.bias': (6,), 'head.weight': (3, 6), 'head.bias': (3,)}\n"
        "assert all(torch.equal(v, d['state_dict'][k]) for k, v in m.state_dict().items())\n"
        "assert d['global_step'] == 4 and set(d['optimizer_states'][0]['state']) == set(d['state_dict'])\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT, env=subprocess_env())
    assert_ok(_run(killed, "--checkpoint-format", "auto"))  # the same command again: auto-resume from the file
    assert_bitwise_equal(rank_weights(killed / "out"), rank_weights(uninterrupted / "out"))


def test_column_blocks_keep_folders_named_once_under_auto_and_are_refused_naming_the_tensor_under_file(tmp_path):
    auto = _run(tmp_path / "auto", "--plan", "columns", "--checkpoint-format", "auto", "--max-steps", "2")
    assert_ok(auto)
    # One line at set-up names the tensor that keeps the run on folders, and its placements.
    named = "'head.weight' is a DTensor with placements (Shard(dim=1)) (shape [3, 6])"
    output = auto.stdout + auto.stderr
    assert output.count(named) == 1 and "torchsnapshot folders" in output.split(named)[0].rsplit("\n", 1)[-1]
    assert (tmp_path / "auto" / "ckpt" / "epoch=0-step=2.ckpt").is_dir()
    refused = _run(tmp_path / "file", "--plan", "columns", "--checkpoint-format", "file", "--max-steps", "2")
    assert refused.returncode != 0
    assert (
        "ValueError: ElasticFT3D(checkpoint_format='file'): 'head.weight' is a DTensor with placements"
        " (Shard(dim=1)) (shape [3, 6])" in refused.stderr
    )
    assert not (tmp_path / "file" / "ckpt").exists() or not list((tmp_path / "file" / "ckpt").iterdir())
