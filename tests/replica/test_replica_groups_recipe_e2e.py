"""docs/replica-groups.md's one-machine recipe, run as the page shows it (tests/docs/markdown.py): a lighthouse on
``127.0.0.1:0``, three one-process groups of examples/replica_groups.py, group 2's torchrun SIGKILLed past the
checkpoint of step 100 and relaunched, then ``lightning-ft report . --job``. What the page promises a reader:

- it runs as written, and prints the lines the page shows (the address the OS chose, the job's report);
- groups 0 and 1 train on through the kill and never restart; the relaunched group 2 reads no checkpoint and heals
  from a live group at a step past the kill;
- nothing the recipe started is left running.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.docs.markdown import DOCS, assert_prints, expected_output, run_recipe
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.slow

PAGE = DOCS / "replica-groups.md"


def _processes_in(folder: Path) -> list[int]:
    """The pids of the live processes whose working directory is ``folder`` (what the recipe started there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == folder:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timeout(360)
def test_the_one_machine_recipe_runs_as_written_and_the_relaunched_group_heals(tmp_path):
    (tmp_path / "examples").symlink_to(Path(REPO_ROOT) / "examples")
    try:
        done = run_recipe(PAGE, "replica-groups", tmp_path, timeout=300, OMP_NUM_THREADS="1")
    finally:
        leftover = _processes_in(tmp_path.resolve())
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
    out = done.stdout
    assert done.returncode == 0, out[-8000:]
    assert leftover == [], "processes the recipe started are still running"
    assert_prints(out, expected_output(PAGE, "replica-groups"))

    # The lighthouse printed the port the OS chose, and the groups used it.
    (address,) = re.findall(r"^TORCHFT_LIGHTHOUSE=http://127\.0\.0\.1:(\d+)$", out, flags=re.M)
    assert int(address) > 0 and f"replica job (lighthouse http://127.0.0.1:{address})" in out

    # Group 2 was lost once, and its relaunch healed from a live group after the kill instead of reading a checkpoint.
    (lost_at,) = map(int, re.findall(r"step (\d+): group 2 lost", out))
    assert lost_at >= 100
    heals = [int(s) for s in re.findall(r"step (\d+): group 2 from group [01],", out)]
    assert [s for s in heals if s > lost_at], out[-4000:]
    relaunch = (tmp_path / "group2b.log").read_text()
    assert "resuming from" not in relaunch

    # The survivors trained through it: one loss line each, no restart, the run's last checkpoint at step 1500.
    for group in (0, 1):
        log = (tmp_path / f"group{group}.log").read_text()
        assert len(re.findall(r"replica group 2 lost at step", log)) == 1, log[-3000:]
        assert "resuming from" not in log
    assert list((tmp_path / "checkpoints").glob("*step=1500.ckpt"))
