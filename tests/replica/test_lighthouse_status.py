"""lightning-ft reads torchft's lighthouse through its status page (``GET /status``: torchft 0.2.0 has no query API):
the real torchft 0.2.0 lighthouse's page reads as its last quorum's members and the heartbeats with their ages; a page
of another layout stops a starting group with an error naming the lighthouse and torchft, never reads as "no group
live"; an unreachable lighthouse reads as nothing known."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lightning_ft import _compat
from lightning_ft.replica.checkpoint_owner import live_peers
from lightning_ft.replica.duplicate_id import refuse_a_live_duplicate
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")


def test_the_real_lighthouses_page_reads_as_its_quorum_and_the_heartbeats_with_their_ages() -> None:
    from torchft.coordination import LighthouseClient

    with lighthouse(min_replicas=2, heartbeat_timeout_ms=1500, join_timeout_ms=100) as address:
        client = LighthouseClient(address, timedelta(seconds=5))
        for rid in ("0:aaaa", "1:bbbb"):
            client.heartbeat(rid)
        joins = [
            threading.Thread(
                target=client.quorum,
                args=(rid, timedelta(seconds=10)),
                kwargs={"address": f"http://node-{rid[0]}:123{rid[0]}", "store_address": "s:1", "step": step},
            )
            for rid, step in (("0:aaaa", 7), ("1:bbbb", 3))
        ]
        for join in joins:
            join.start()
        for join in joins:
            join.join(timeout=30)
        client.heartbeat("2:cccc")  # heartbeats, not in the quorum
        status = _compat.lighthouse_status(address, timeout_s=5)
        assert status is not None
        assert status.members == {"0:aaaa": (7, "http://node-0:1230"), "1:bbbb": (3, "http://node-1:1231")}
        assert set(status.heartbeats) == {"0:aaaa", "1:bbbb", "2:cccc"}
        assert all(0 <= age < 1.5 and not old for age, old in status.heartbeats.values()), status.heartbeats
        time.sleep(1.0)
        client.heartbeat("2:cccc")
        time.sleep(0.8)  # 0 and 1 past the heartbeat timeout, 2 not
        status = _compat.lighthouse_status(address, timeout_s=5)
        assert {rid: old for rid, (_, old) in status.heartbeats.items()} == {
            "0:aaaa": True,
            "1:bbbb": True,
            "2:cccc": False,
        }
        assert status.heartbeats["0:aaaa"][0] >= 1.5 > status.heartbeats["2:cccc"][0]
        assert _compat.lighthouse_live_members(address, timeout_s=5) == {}  # the quorum's members are dead


@contextmanager
def _serving(page: str) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "page",
    [
        '{"quorum": {"participants": []}, "heartbeats": {}}',  # a JSON API instead of the dashboard
        '<h2>Heartbeats</h2><ul><li class="heartbeat">0:aaaa: last seen at 12:00</li></ul>',  # another item format
        '<h3>Previous Quorum</h3><div class="member"><i>0:aaaa</i></div><h2>Heartbeats</h2><ul></ul>',
    ],
)
def test_a_status_page_of_another_layout_is_an_error_naming_the_lighthouse_and_torchft(page: str) -> None:
    with _serving(page) as address:
        with pytest.raises(
            _compat.LighthouseStatusError, match=r"lighthouse at http://127\.0\.0\.1:\d+ .*torchft 0\.2\.0"
        ):
            _compat.lighthouse_status(address, timeout_s=5)
        # Where a starting group asks: it stops and says why, instead of reading the page as "no group live".
        with pytest.raises(_compat.LighthouseStatusError):
            live_peers(address, "0", newest_on_disk=None, timeout_s=5)
        with pytest.raises(_compat.LighthouseStatusError):
            refuse_a_live_duplicate(address, "0", timeout=timedelta(seconds=1), connect_timeout_s=5)


def test_an_empty_lighthouse_reads_as_no_members_and_no_heartbeats() -> None:
    with lighthouse() as address:
        status = _compat.lighthouse_status(address, timeout_s=5)
    assert status is not None and status.members == {} and status.heartbeats == {}
    assert _compat.lighthouse_status(address, timeout_s=2) is None  # stopped: unreachable, nothing known
