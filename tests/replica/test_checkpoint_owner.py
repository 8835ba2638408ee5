"""Who writes checkpoints in replica mode, and whether a starting group sees a live quorum (against a real lighthouse,
driven through torchft's own client)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from lightning_ft.replica.checkpoint_owner import checkpoint_writer, live_peers, writing_process
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")


def test_the_writer_is_the_lowest_replica_id_numbers_by_value() -> None:
    assert checkpoint_writer(["2", "10", "1"]) == "1"
    assert checkpoint_writer(["10", "9"]) == "9"  # not "10", as a string sort would have it
    assert checkpoint_writer(["b", "a", "3"]) == "3"
    assert checkpoint_writer(["b", "a"]) == "a"
    assert checkpoint_writer([]) is None


def test_of_two_processes_with_the_writers_id_only_one_writes() -> None:
    """A process and an orphan (or a second launch) with the lowest id, in one quorum: the lower full id writes."""
    assert writing_process(["1:b", "0:z", "0:a", "10:c"]) == "0:a"
    assert writing_process(["1:b", "10:c"]) == "1:b"
    assert writing_process([]) is None


def test_live_peers_are_the_last_quorums_members_that_still_heartbeat_and_are_not_behind_the_disk() -> None:
    from torchft.coordination import LighthouseClient

    with lighthouse(heartbeat_timeout_ms=1000) as address:
        assert live_peers(address, "0", newest_on_disk=None, timeout_s=5) == {}  # no quorum yet: read the disk
        client = LighthouseClient(address, timedelta(seconds=5))
        client.heartbeat("1:uuid")
        client.quorum("1:uuid", timedelta(seconds=5), address="a", store_address="b", step=7, world_size=1)
        assert live_peers(address, "0", newest_on_disk=5, timeout_s=5) == {"1": 7}
        assert live_peers(address, "0", newest_on_disk=7, timeout_s=5) == {"1": 7}
        assert live_peers(address, "0", newest_on_disk=8, timeout_s=5) == {}  # healing from it would rewind
        assert live_peers(address, "1", newest_on_disk=None, timeout_s=5) == {}  # itself (a dead predecessor)
        time.sleep(1.5)  # past the heartbeat timeout: the member is dead (a whole-job failure)
        assert live_peers(address, "0", newest_on_disk=None, timeout_s=5) == {}
    assert live_peers(address, "0", newest_on_disk=None, timeout_s=2) == {}  # no lighthouse: read the disk
