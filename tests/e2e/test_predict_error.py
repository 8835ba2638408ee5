"""One rank's error in ``predict`` after ``fit`` ends every process, as under ``DDPStrategy``.

darts' ``predict`` of one series at two ranks raises on rank 1 while Lightning makes the predict loader; a library's
predict makes a Trainer of its own after the fit. Launched by Lightning itself (``devices=2``, no torchrun): nothing
kills the process that did not fail, so it must end on its own, through the collective that finds its peer gone.
``predict_error_script.py`` writes each process's record before its error propagates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

SCRIPT = Path(__file__).with_name("predict_error_script.py")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_an_error_on_one_rank_in_predict_after_fit_ends_every_process(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), "elasticft", "loader"],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=300)  # about 70 s on a loaded 2-core machine, DDPStrategy as long
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the process it started
        proc.communicate()
        pytest.fail(f"still running {time.monotonic() - start:.0f} s after the launch: a process outlived its peer")
    assert proc.returncode != 0, stderr[-3000:]
    records = {int(p.stem.removeprefix("exit-rank")): json.loads(p.read_text()) for p in tmp_path.glob("exit-*.json")}
    assert sorted(records) == [0, 1], stderr[-3000:]
    assert records[1]["error"].startswith("AssertionError: the library's own error")
    assert "Connection closed by peer" in records[0]["error"], records[0]
