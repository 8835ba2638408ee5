"""A torchft lighthouse for tests, bound to 127.0.0.1 on a port the OS chooses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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
