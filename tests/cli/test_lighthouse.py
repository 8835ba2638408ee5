"""``lightning-ft lighthouse``: torchft's lighthouse bound where the user says, its address printed on one line, a clean
stop on SIGTERM or SIGINT, and every mistake reported before anything is bound."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from datetime import timedelta

import psutil
import pytest

from lightning_ft.cli import lighthouse as lighthouse_cli
from lightning_ft.cli import main
from tests.helpers import REPO_ROOT, subprocess_env

pytest.importorskip("torchft")

_START_TIMEOUT_S = 180  # importing torchft imports torch: up to ~25 s on a loaded 2-core machine


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    """Start the command in a subprocess and return it with its first stdout line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_ft.cli", "lighthouse", *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=_START_TIMEOUT_S)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"no address line within {_START_TIMEOUT_S} s; stderr: {proc.communicate()[1][-3000:]}")
    return proc, line


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lighthouse_on_loopback_prints_its_address_answers_a_client_and_stops_cleanly(stop_signal):
    proc, line = _start("--bind", "127.0.0.1:0", "--min-replicas", "1", "--join-timeout-s", "0.2")
    try:
        name, _, url = line.strip().partition("=")
        assert name == "TORCHFT_LIGHTHOUSE", line
        host, _, port = url.removeprefix("http://").rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0, line
        # Bound to the loopback address given and nothing else: no other interface can reach it.
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"]
        assert listening == [("127.0.0.1", int(port))], listening
        # The status page answers over HTTP, and torchft's own client gets a quorum from the printed address.
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200 and b"Lighthouse" in page.read()
        from torchft.coordination import LighthouseClient

        client = LighthouseClient(url, connect_timeout=timedelta(seconds=30))
        quorum = client.quorum(
            replica_id="probe", timeout=timedelta(seconds=60), address="a", store_address="s", step=3, world_size=1
        )
        assert [(m.replica_id, m.step) for m in quorum.participants] == [("probe", 3)]
    finally:
        proc.send_signal(stop_signal)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert err.rstrip().endswith("lightning-ft lighthouse: stopped"), err[-3000:]
    assert out == "", "the address line is the only line on stdout"


def test_the_lighthouse_starts_without_importing_torch():
    """A restarted lighthouse keeps every group waiting while it starts: the command loads torchft's native server
    alone (torch's import is 2 s idle, 10-30 s on a loaded machine), and the class is torchft's own."""
    script = (
        "import sys\n"
        "from lightning_ft.cli.lighthouse import lighthouse_server_class\n"
        "server = lighthouse_server_class()\n"
        "instance = server(bind='127.0.0.1:0', min_replicas=1)\n"
        "instance.shutdown()\n"
        "print('torch' in sys.modules)\n"
        "import torchft.coordination\n"
        "print(server is torchft.coordination.LighthouseServer)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--bind", "127.0.0.1:0", "--min-replicas", "0"], "--min-replicas=0"),
        (["--bind", "127.0.0.1", "--min-replicas", "1"], "--bind=127.0.0.1"),
        (["--bind", "127.0.0.1:65536", "--min-replicas", "1"], "--bind=127.0.0.1:65536"),
        (["--bind", "::1:0", "--min-replicas", "1"], "--bind=::1:0"),
        (["--bind", "127.0.0.1:0", "--min-replicas", "1", "--heartbeat-timeout-s", "0"], "--heartbeat-timeout-s=0"),
        (["--bind", "127.0.0.1:0", "--min-replicas", "1", "--join-timeout-s", "nan"], "--join-timeout-s=nan"),
        (["--bind", "127.0.0.1:0", "--min-replicas", "1", "--quorum-tick-s", "-1"], "--quorum-tick-s=-1"),
        (["--bind", "192.0.2.1:0", "--min-replicas", "1"], "--bind=192.0.2.1:0"),  # TEST-NET-1: on no host
    ],
)
def test_a_bad_option_exits_2_with_one_line_naming_it_and_binds_nothing(capsys, args, named):
    assert main(["lighthouse", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "", "no address is printed"
    assert err.count("\n") == 1 and err.startswith(f"lightning-ft lighthouse: error: {named}:"), err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--min-replicas", "two"], "--min-replicas"),
        ([], "--min-replicas"),
        (["--min-replicas", "1", "--bind-to", "x"], "--bind-to"),
    ],
)
def test_argparse_usage_errors_exit_2_naming_the_option(capsys, args, named):
    with pytest.raises(SystemExit) as exit:
        main(["lighthouse", *args])
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_an_address_in_use_is_a_clear_error(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["lighthouse", "--bind", f"127.0.0.1:{port}", "--min-replicas", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"lightning-ft lighthouse: error: --bind=127.0.0.1:{port}: the address is already in use (another"
        " lighthouse?): choose another port or stop it\n"
    )


def test_the_options_reach_torchft_in_milliseconds_and_the_loopback_address_is_printed(monkeypatch, capsys):
    started = {}

    class Recorder:
        def __init__(self, **kwargs):
            started.update(kwargs)

        def address(self):
            signal.raise_signal(signal.SIGTERM)  # stop at once: the handler the command installed ends its wait
            return "http://some-host-name:4242"

        def shutdown(self):
            started["shut down"] = True

    monkeypatch.setattr(lighthouse_cli, "lighthouse_server_class", lambda: Recorder)
    args = ["--bind", "127.0.0.1:0", "--min-replicas", "2", "--heartbeat-timeout-s", "0.5", "--join-timeout-s", "3"]
    before = signal.getsignal(signal.SIGTERM)
    assert main(["lighthouse", *args]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
    assert started == {
        "bind": "127.0.0.1:0",
        "min_replicas": 2,
        "join_timeout_ms": 3000,
        "quorum_tick_ms": 100,
        "heartbeat_timeout_ms": 500,
        "shut down": True,
    }
    # The address bound, not the host name torchft reports (which need not resolve to the loopback address).
    assert capsys.readouterr().out == "TORCHFT_LIGHTHOUSE=http://127.0.0.1:4242\n"


def test_the_defaults_give_a_stall_of_about_a_second(monkeypatch):
    started = {}

    class Recorder:
        def __init__(self, **kwargs):
            started.update(kwargs)

        def address(self):
            signal.raise_signal(signal.SIGINT)
            return "http://h:29510"

        def shutdown(self):
            pass

    monkeypatch.setattr(lighthouse_cli, "lighthouse_server_class", lambda: Recorder)
    before = signal.getsignal(signal.SIGINT)
    assert main(["lighthouse", "--min-replicas", "1"]) == 0
    assert signal.getsignal(signal.SIGINT) is before
    assert (started["bind"], started["heartbeat_timeout_ms"], started["join_timeout_ms"]) == (
        "0.0.0.0:29510",
        1000,
        1000,
    )


@pytest.mark.parametrize(
    ("bind", "printed"),
    [
        ("[::1]:0", "http://[::1]:4242"),
        ("localhost:0", "http://localhost:4242"),
        ("0.0.0.0:0", "http://some-host-name:4242"),  # a wildcard: the host's name, as torchft gives it
        ("[::]:0", "http://some-host-name:4242"),
    ],
)
def test_the_printed_address_is_the_host_bound_or_for_a_wildcard_the_host_s_name(monkeypatch, capsys, bind, printed):
    binds = []

    class Recorder:
        def __init__(self, **kwargs):
            binds.append(kwargs["bind"])

        def address(self):
            signal.raise_signal(signal.SIGTERM)
            return "http://some-host-name:4242"

        def shutdown(self):
            pass

    monkeypatch.setattr(lighthouse_cli, "lighthouse_server_class", lambda: Recorder)
    assert main(["lighthouse", "--bind", bind, "--min-replicas", "1"]) == 0
    assert binds == [bind]
    assert capsys.readouterr().out == f"TORCHFT_LIGHTHOUSE={printed}\n"
