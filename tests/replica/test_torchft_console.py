"""torchft's console output in the replica mode: its Rust INFO lines off unless asked for (``RUST_LOG``,
``LIGHTNING_FT_TORCHFT_LOGS=1``), and the traceback torchft logs for a failed collective replaced by its text, which
lightning-ft says in its own line. (A real group loss: tests/replica/test_replica_defaults_e2e.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from lightning_ft.replica.torchft_console import TorchftConsole, short_error
from tests.helpers import REPO_ROOT, subprocess_env

pytest.importorskip("torchft")

_SERVE = textwrap.dedent(
    """
    import os
    from datetime import timedelta
    from lightning_ft._torchft_native import import_torchft
    import_torchft()
    from torchft.coordination import LighthouseClient, LighthouseServer
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    address = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    # A quorum of one: the lighthouse logs it (at INFO) before it answers.
    LighthouseClient(address, timedelta(seconds=30)).quorum(replica_id="a", timeout=timedelta(seconds=30))
    print("RUST_LOG" in os.environ, flush=True)
    server.shutdown()
    """
)


def _serve(**env: str) -> subprocess.CompletedProcess:
    base = subprocess_env(**env)
    for name in ("RUST_LOG", "LIGHTNING_FT_TORCHFT_LOGS"):
        if name not in env:
            base.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", _SERVE], cwd=REPO_ROOT, env=base, capture_output=True, text=True, timeout=120
    )


def test_torchft_is_imported_without_its_info_lines_and_the_environment_is_left_as_it_was():
    quiet = _serve()
    assert quiet.returncode == 0, quiet.stderr
    assert "[INFO]" not in quiet.stderr and quiet.stdout.strip() == "False", (quiet.stdout, quiet.stderr)


@pytest.mark.parametrize("env", [{"RUST_LOG": "info"}, {"LIGHTNING_FT_TORCHFT_LOGS": "1"}])
def test_torchft_s_info_lines_come_back_when_asked_for(env):
    loud = _serve(**env)
    assert loud.returncode == 0, loud.stderr
    assert "[INFO] [torchft::lighthouse] - Quorum!" in loud.stderr, loud.stderr


def _torchft_logs_a_failed_allreduce() -> None:
    """What torchft 0.2.0's ``_ManagedWork.wait`` logs when the all-reduce of a lost group fails."""
    from torchft.manager import _ManagerLogger

    class Manager:
        def current_step(self) -> int:
            return 102

    error = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40644:"
        " Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
        " Check the logs of the remote worker before reporting an error. GLHF!"
    )
    torchft_log = _ManagerLogger(Manager(), "0:uuid", 0)  # type: ignore[arg-type]
    try:
        raise error
    except RuntimeError as e:
        torchft_log.exception(f"got exception waiting for work {e}")
    torchft_log.warn("Unable to reset NCCL flight recorder recording so traces will be incorrect.")
    torchft_log.exception("got exception in pg configure: something else")


def test_a_failed_collective_is_kept_as_text_not_printed_and_other_errors_still_are(caplog, monkeypatch):
    monkeypatch.delenv("LIGHTNING_FT_TORCHFT_LOGS", raising=False)
    console = TorchftConsole().install()
    try:
        with caplog.at_level(logging.INFO, logger="torchft.manager"):
            _torchft_logs_a_failed_allreduce()
    finally:
        console.uninstall()
    printed = [r.getMessage() for r in caplog.records if r.name == "torchft.manager"]
    assert len(printed) == 1 and "got exception in pg configure" in printed[0], printed
    assert console.take_failure() == "Read error [127.0.0.1]:40644: Connection reset by peer"
    assert console.take_failure() is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchft.manager"):  # uninstalled: torchft's own output again
        _torchft_logs_a_failed_allreduce()
    assert len([r for r in caplog.records if r.name == "torchft.manager"]) == 3


def test_asked_for_torchft_s_logs_the_traceback_is_printed_as_torchft_prints_it(caplog, monkeypatch):
    monkeypatch.setenv("LIGHTNING_FT_TORCHFT_LOGS", "1")
    console = TorchftConsole().install()
    try:
        with caplog.at_level(logging.INFO, logger="torchft.manager"):
            _torchft_logs_a_failed_allreduce()
    finally:
        console.uninstall()
    assert len([r for r in caplog.records if r.name == "torchft.manager"]) == 3


def test_a_collective_error_in_a_few_words():
    assert short_error("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:15063.") == (
        "Connection closed by peer [127.0.0.1]:15063"
    )
    assert short_error("Timed out waiting 5000ms for recv operation to complete") == (
        "Timed out waiting 5000ms for recv operation to complete"
    )
