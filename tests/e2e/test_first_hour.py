"""The README's first hour under real torchrun: the quick start runs as written on CPU processes, resumes on another
world size, loads for inference; a run that fails in set-up shows the user's own error, last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, assert_prints, expected_output, run_recipe
from tests.e2e._torchrun import torchrun
from tests.helpers import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
FAILING = Path(__file__).with_name("failing_setup_script.py")


def test_the_quick_start_runs_as_written_on_two_cpu_processes_and_resumes_on_one(tmp_path):
    """The README's recipe, run as the README shows it (tests/docs/markdown.py), from a fresh folder beside the
    examples: torchrun on 2 processes, then on 1, which resumes and prints the line the README shows."""
    (tmp_path / "examples").symlink_to(Path(REPO_ROOT) / "examples")
    done = run_recipe(README, "quickstart", tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-8000:]
    out = done.stdout
    assert "torchrun started 2 process(es) per node on 1 node(s)" in out
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file() and not last.is_symlink()  # a checkpoint of its own, as Lightning's `last` is
    assert (tmp_path / "checkpoints" / "epoch=2-step=40.ckpt").is_file()  # the file Lightning writes, at 2 ranks
    assert "lightning-ft: checkpoints are torch.save files" in out
    # Lightning's own loader reads the checkpoint of two ranks (the README's inference section).
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, 'examples'); import quickstart;"
            f" m = quickstart.Regressor.load_from_checkpoint({str(tmp_path / 'checkpoints' / 'epoch=2-step=40.ckpt')!r});"
            " print(type(m).__name__, m.hparams.lr)",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["Regressor", "0.01"]

    # The second run's line, as the README shows it, and exactly: `last.ckpt`, a checkpoint of its own, the newest
    # committed one of step 40 (written after the top-k one).
    assert_prints(out, expected_output(README, "quickstart"))
    line = [ln for ln in out.splitlines() if ln.startswith("lightning-ft: resuming from")]
    assert line == [
        f"lightning-ft: resuming from {tmp_path / 'checkpoints' / 'last.ckpt'} (step 40): world size 2"
        " -> 1, gradient accumulation 1 -> 2, LR x1.00 (unchanged)"
    ]

    # The README's inference line, in a plain process without torch.distributed.
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, 'examples'); from quickstart import Regressor;"
            " from lightning_ft import load_from_checkpoint;"
            f" m = load_from_checkpoint(Regressor, {str(tmp_path / 'checkpoints' / 'last.ckpt')!r});"
            " print(type(m).__name__, m.training, m.hparams.lr)",
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["Regressor", "False", "0.01"]


def test_a_run_failing_in_configure_model_under_torchrun_shows_the_users_error_last(tmp_path):
    proc = torchrun(str(tmp_path), script=FAILING, max_restarts=1, timeout=300)
    assert proc.returncode != 0
    err = proc.stderr
    assert "is not attached to a `Trainer`" not in err
    assert "During handling of the above exception, another exception occurred" not in err
    assert "lightning-ft: teardown failed" not in err
    # Every rank of both attempts ends with the user's error; torchrun's own summary comes after them.
    # (torch prefixes each line a worker prints for an uncaught exception with "[rank<N>]: ".)
    errors = re.findall(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception)): (.*)$", err, flags=re.M)
    workers = [e for e in errors if not e[0].endswith("ChildFailedError")]
    assert workers, err[-6000:]
    assert workers[-1] == ("UserConfigError", "the user's own error in configure_model"), workers
    assert sum(e[1] == "the user's own error in configure_model" for e in workers) == 4, err[-6000:]
