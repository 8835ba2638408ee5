"""A torchft lighthouse for tests, bound to 127.0.0.1 on a port the OS chooses: in the test's process
(:func:`lighthouse`), or as ``lightning-ft lighthouse`` in a process of its own that a test can SIGKILL and start again
at the same address (:class:`Lighthouse`)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import REPO_ROOT, subprocess_env


@contextmanager
def lighthouse(*, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 500) -> Iterator[str]:
    """Yield the lighthouse's address (``http://127.0.0.1:<port>``); shut it down on exit."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        port = server.address().rsplit(":", 1)[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


class Lighthouse:
    """``lightning-ft lighthouse`` in its own process, on a port the OS chose at its first start; :meth:`kill` ends it
    with SIGKILL, :meth:`start` starts it again at the same address (what a restart loop or a Deployment does).
    ``options``: more options of the command (``--join-timeout-s 3``); the log of start ``n`` is
    ``<tmp>/lighthouse<n>.log``."""

    def __init__(self, tmp: Path, *, min_replicas: int, options: tuple[str, ...] = ()) -> None:
        self.tmp, self.min_replicas, self.options = tmp, min_replicas, options
        self.port = 0
        self.starts = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start it; return the time (Unix seconds) it accepts connections."""
        log = open(self.tmp / f"lighthouse{self.starts}.log", "w")  # noqa: SIM115 - the child holds it
        args = ["--bind", f"127.0.0.1:{self.port}", "--min-replicas", str(self.min_replicas), *self.options]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_ft.cli", "lighthouse", *args],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        self.starts += 1
        line = self.proc.stdout.readline()  # TORCHFT_LIGHTHOUSE=http://127.0.0.1:<port>, once it listens
        match = re.match(r"TORCHFT_LIGHTHOUSE=http://127\.0\.0\.1:(\d+)", line)
        assert match, f"lighthouse did not start: {line!r}"
        assert self.port in (0, int(match.group(1)))
        self.port = int(match.group(1))
        while not accepts(self.port):
            time.sleep(0.05)
        return time.time()

    def kill(self) -> float:
        """SIGKILL it; return the time."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        return time.time()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def accepts(port: int) -> bool:
    """Whether something accepts a TCP connection on ``127.0.0.1:port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
