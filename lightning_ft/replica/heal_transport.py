"""The HTTP server and client that copy a healthy group's state to a joining one (torchft ``CheckpointTransport``).

torchft's own ``HTTPTransport`` listens on every interface and reads what it receives with unrestricted unpickling
(``torch.load(weights_only=False)``), which lightning-ft never does (docs/checkpointing.md). This transport keeps
torchft's protocol (the manager asks it for its address as metadata, hands it the state to serve for one step, and
stops it serving at the commit vote) and differs in three ways:

- it binds the address it advertises when one is given (``ReplicaGroups(address=...)``), e.g. ``127.0.0.1``;
- the state is serialized once, when the manager hands it over (``torch.save`` into memory), so what is served is the
  state at that moment whatever the training loop does next;
- the receiver loads it with torch's restricted unpickler and the globals lightning-ft allows for checkpoints
  (:func:`~lightning_ft.checkpoint.internal.load_pickled`), and records how many bytes it took and how long.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torchft.checkpointing import CheckpointTransport

from lightning_ft.checkpoint.internal import load_pickled, pickled_bytes

__all__ = ["IDENTITY_PATH", "HealTransport", "serving_process"]

IDENTITY_PATH = "/identity"
"""``GET`` it on a group's heal server: ``{"pid": ..., "host": ...}`` of the process that serves."""

_log = logging.getLogger(__name__)
_WHERE = "the state a replica group sent to heal this one"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


class HealTransport(CheckpointTransport[dict[str, Any]]):
    """Serve this group's state to joining groups and fetch a healthy group's state when this one joins.

    Args:
        address: host to bind and advertise; ``None``: this machine's host name, listening on every interface.
        timeout: how long a fetch, or a request waiting for the state to be handed over, may take.

    Thread use: torchft's manager calls :meth:`send_checkpoint` and :meth:`recv_checkpoint` from its quorum thread
    and :meth:`disallow_checkpoint` from the training thread; the server answers from its own threads.
    """

    def __init__(self, *, address: str | None, timeout: timedelta) -> None:
        self._timeout = timeout
        self._ready = threading.Condition()
        self._payload: bytes | None = None
        self._step = -1
        self.last_received: tuple[int, float] | None = None
        """``(bytes, seconds)`` of the last state fetched from a peer."""
        transport = self
        request_timeout_s = timeout.total_seconds()

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/") == IDENTITY_PATH:  # who serves: named when another process takes the id
                    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    self.send_error(400, f"expected /checkpoint/<step>, got {self.path}")
                    return
                payload = transport._wait_for(int(parts[1]))
                if payload is None:
                    self.send_error(409, f"no state for step {parts[1]} (serving step {transport._step})")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                _log.debug("heal server: " + format, *args)

        host = address or ""
        server_class = _Server
        if not address or _is_ipv6(address):
            server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        self._server = server_class((host, 0), Handler)
        self._advertised = address or socket.gethostname()
        self._thread = threading.Thread(target=self._server.serve_forever, name="lightning-ft-heal-server", daemon=True)
        self._thread.start()

    def _wait_for(self, step: int) -> bytes | None:
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._ready:
            while self._step != step or self._payload is None:
                if self._step > step:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._ready.wait(left)
            return self._payload

    def metadata(self) -> str:
        host = f"[{self._advertised}]" if _is_ipv6(self._advertised) else self._advertised
        return f"http://{host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        payload = pickled_bytes(state_dict, _WHERE)
        with self._ready:
            self._payload, self._step = payload, step
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        started = time.monotonic()
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as response:  # noqa: S310
            data = response.read()
        state = load_pickled(data, _WHERE)
        self.last_received = (len(data), time.monotonic() - started)
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def serving_process(metadata: str, *, timeout_s: float) -> dict[str, Any] | None:
    """``{"pid", "host"}`` of the process whose heal server ``metadata`` (:meth:`HealTransport.metadata`) names;
    ``None`` when it cannot be asked (another transport, gone, a timeout)."""
    if not metadata.startswith("http") or not metadata.rstrip("/").endswith("/checkpoint"):
        return None
    url = metadata.rstrip("/").removesuffix("/checkpoint") + IDENTITY_PATH
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            found = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
