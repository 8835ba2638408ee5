"""One replica id, one live process: the join check against a real lighthouse (driven through torchft's own client),
the quorum's rule, and the watch on the torchrun agent. The end-to-end runs under torchrun (a SIGKILLed agent, a
second launch with a live group's id) are in tests/replica/test_replica_duplicate_e2e.py."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest

from lightning_ft.replica.duplicate_id import (
    ORPHAN_EXIT_CODE,
    AgentWatch,
    DuplicateReplicaError,
    duplicates_in_quorum,
    refuse_a_live_duplicate,
)
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")


@contextmanager
def heartbeating(address: str, replica_id: str, *, step: int, every_s: float = 0.2) -> Iterator[None]:
    """A live process with ``replica_id`` (torchft's full id): in the lighthouse's quorum at ``step``, heartbeating
    every ``every_s`` until the block ends."""
    from torchft.coordination import LighthouseClient

    client = LighthouseClient(address, timedelta(seconds=5))
    client.heartbeat(replica_id)
    client.quorum(replica_id, timedelta(seconds=5), address="http://node-a:4321", store_address="b", step=step)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            client.heartbeat(replica_id)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_starting_group_refuses_while_another_process_with_its_id_heartbeats() -> None:
    with lighthouse(heartbeat_timeout_ms=3000) as address, heartbeating(address, "0:older", step=7):
        with pytest.raises(DuplicateReplicaError) as raised:
            refuse_a_live_duplicate(address, "0", timeout=timedelta(seconds=1), connect_timeout_s=5)
        message = str(raised.value)
        assert "REPLICA_GROUP_ID=0" in message and "0:older" in message, message
        assert "manager http://node-a:4321" in message and "at step 7" in message, message
        # Another group's id is not this one's: no refusal.
        refuse_a_live_duplicate(address, "1", timeout=timedelta(seconds=1), connect_timeout_s=5)


def test_a_just_restarted_groups_last_heartbeat_does_not_refuse_its_successor() -> None:
    """torchrun restarted the group: its previous worker's heartbeat is still fresh for the lighthouse's heartbeat
    timeout, but it is not renewed, so the new worker starts (without waiting for the timeout)."""
    with lighthouse(heartbeat_timeout_ms=30_000) as address:
        with heartbeating(address, "0:previous", step=3):
            pass  # the previous worker died here
        refuse_a_live_duplicate(address, "0", timeout=timedelta(seconds=20), connect_timeout_s=5)


def test_an_unreachable_lighthouse_is_no_refusal() -> None:
    with lighthouse() as address:
        pass
    refuse_a_live_duplicate(address, "0", timeout=timedelta(seconds=1), connect_timeout_s=2)


def test_at_the_quorum_the_newer_process_refuses_and_the_older_trains_on() -> None:
    ids = ["0:aaa", "0:bbb", "1:ccc"]
    with pytest.raises(
        DuplicateReplicaError, match=r"REPLICA_GROUP_ID=0 is taken by a live process \(torchft id 0:aaa"
    ):
        duplicates_in_quorum(ids, 1, first_quorum=True)
    assert duplicates_in_quorum(ids, 0, first_quorum=False) == ["0:bbb"]
    assert duplicates_in_quorum(ids, 2, first_quorum=True) == []


def test_a_worker_whose_agent_is_gone_says_so_and_exits() -> None:
    exits: list[int] = []
    orphaned: list[int] = []
    done = threading.Event()

    def exit_(code: int) -> None:
        exits.append(code)
        done.set()

    watch = AgentWatch(
        os.getppid() + 100_000,  # not the parent: as after the agent's death
        "0",
        interval=timedelta(seconds=0.05),
        on_orphaned=orphaned.append,
        exit=exit_,
    )
    assert done.wait(10)
    watch.stop()
    assert exits == [ORPHAN_EXIT_CODE] and orphaned == [os.getppid()]


def test_a_worker_whose_agent_lives_goes_on() -> None:
    exits: list[int] = []
    watch = AgentWatch(os.getppid(), "0", interval=timedelta(seconds=0.05), exit=exits.append)
    threading.Event().wait(0.5)
    watch.stop()
    assert exits == []
