"""The parts that let replica groups outlive their lighthouse (lightning_ft/replica/lighthouse_watch.py): the quorum
wait that measures an outage and decides when to give up (on a fake clock), the probe and the set-up wait against
torchft's real lighthouse, quorum ids that stay unique across its restarts, and the Manager's settings."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from lightning_ft import ReplicaGroups, _compat
from lightning_ft.replica.lighthouse_watch import (
    DOWN_AFTER,
    PROBE_AFTER_S,
    LighthouseGone,
    LighthouseProbe,
    LighthouseWatch,
    QuorumIds,
    QuorumTimeout,
    wait_for_lighthouse,
)
from tests.helpers import free_port
from tests.replica._lighthouse import lighthouse

# ------------------------------------------------------------------------------------------------ the wait


@dataclass
class FakeRun:
    """A fake clock, a quorum that comes at ``quorum_at`` and a lighthouse that does not answer in ``down``."""

    quorum_at: float = float("inf")
    down: tuple[float, float] = (float("inf"), float("inf"))
    now: float = 0.0
    probes: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def done(self, seconds: float) -> bool:
        if self.now + seconds >= self.quorum_at:
            self.now = max(self.now, self.quorum_at)
            return True
        self.now += seconds
        return False

    def probe(self) -> bool:
        self.probes.append(self.now)
        self.now += 0.01  # a probe takes a little time
        return not (self.down[0] <= self.now < self.down[1])

    def watch(self, wait_s: float = 300.0) -> LighthouseWatch:
        return LighthouseWatch(
            "http://lh:1",
            wait=timedelta(seconds=wait_s),
            probe=self.probe,
            clock=self.clock,
            wall=lambda: 1e9 + self.now,
        )


def test_a_quick_quorum_probes_nothing() -> None:
    run = FakeRun(quorum_at=0.2)
    record = run.watch().wait(run.done, quorum_timeout_s=36)
    assert run.probes == [] and record.down_s == 0 and record.down_since is None
    assert record.waited_s == pytest.approx(0.2)


def test_an_outage_is_measured_from_the_first_unanswered_probe_to_the_first_answered_one() -> None:
    run = FakeRun(down=(3.0, 13.0), quorum_at=14.0)  # the lighthouse down 10 s, the quorum a second after
    record = run.watch().wait(run.done, quorum_timeout_s=5)  # longer than the quorum timeout: down time is not counted
    assert record.down_s == pytest.approx(10.0, abs=0.3)
    assert record.down_since == pytest.approx(1e9 + 3.0, abs=0.3)
    assert record.waited_s == pytest.approx(14.0)
    assert min(run.probes) >= PROBE_AFTER_S
    # While it does not answer it is probed every 0.1 s (a restarted lighthouse hears the group at once).
    during = [t for t in run.probes if 3.5 < t < 12.5]
    assert max(b - a for a, b in zip(during, during[1:], strict=False)) < 0.15


def test_one_unanswered_probe_is_not_an_outage() -> None:
    run = FakeRun(down=(2.0, 2.12), quorum_at=4.0)
    assert run.watch().wait(run.done, quorum_timeout_s=36).down_s == 0
    assert DOWN_AFTER == 2


def test_a_lighthouse_that_stays_down_ends_the_wait_after_lighthouse_wait() -> None:
    run = FakeRun(down=(1.0, float("inf")))
    with pytest.raises(LighthouseGone) as raised:
        run.watch(wait_s=20).wait(run.done, quorum_timeout_s=5)
    assert raised.value.waited_s == pytest.approx(20.0, abs=0.2)
    assert run.now == pytest.approx(21.0, abs=0.3)  # from its first unanswered probe, not from the quorum's start
    assert "http://lh:1 did not answer for 20 s" in str(raised.value)
    assert "lighthouse_wait=timedelta(seconds=20)" in str(raised.value)


def test_a_lighthouse_that_answers_without_a_quorum_ends_the_wait_after_the_quorum_timeout() -> None:
    run = FakeRun()
    with pytest.raises(QuorumTimeout):
        run.watch().wait(run.done, quorum_timeout_s=36)
    assert run.now == pytest.approx(36.0, abs=0.3)
    # After an outage the quorum timeout runs again from the lighthouse's return.
    run = FakeRun(down=(30.0, 50.0))
    with pytest.raises(QuorumTimeout):
        run.watch().wait(run.done, quorum_timeout_s=36)
    assert run.now == pytest.approx(86.0, abs=0.3)


# ------------------------------------------------------------------------------------------------ the probe


def test_the_probe_heartbeats_to_the_real_lighthouse_and_says_at_once_when_nothing_listens() -> None:
    with lighthouse() as address:
        assert LighthouseProbe(address)()  # before the first quorum: its index page
        probe = LighthouseProbe(address, full_id=lambda: "7:abcd")
        assert probe()
        status = _compat.lighthouse_status(address, timeout_s=5)
        assert status is not None and "7:abcd" in status.heartbeats  # a heartbeat: the lighthouse knows the group
    started = time.monotonic()
    assert not probe() and not LighthouseProbe(address)()
    assert time.monotonic() - started < 1.0  # refused: no wait for torchft's connection retries


def test_a_starting_group_waits_for_a_lighthouse_that_comes_late() -> None:
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    servers = []

    def start_later() -> None:
        from torchft.coordination import LighthouseServer

        time.sleep(1.5)
        servers.append(LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1))

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        waited = wait_for_lighthouse(address, timedelta(seconds=60))
    finally:
        thread.join()
        for server in servers:
            server.shutdown()
    assert 1.0 < waited < 30


def test_a_starting_group_gives_up_on_a_lighthouse_that_never_comes() -> None:
    now = [0.0]
    with pytest.raises(LighthouseGone, match=r"did not answer for 10 s \(ReplicaGroups\(lighthouse_wait="):
        wait_for_lighthouse(
            "http://lh:1",
            timedelta(seconds=10),
            probe=lambda: False,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )
    assert now[0] == pytest.approx(10.0, abs=0.2)


# ------------------------------------------------------------------------------------------------ quorum ids


class Result:
    """The fields of torchft's ``QuorumResult`` that QuorumIds reads and writes."""

    def __init__(self, quorum_id: int, replica_ids: list[str], max_step: int) -> None:
        self.quorum_id, self.replica_ids, self.max_step = quorum_id, replica_ids, max_step


ABC = ["0:a", "1:b", "2:c"]


def test_every_member_of_a_quorum_gets_the_same_id_and_a_quorum_like_the_last_keeps_it() -> None:
    members = [QuorumIds() for _ in ABC]
    first = {ids.assign(Result(2, ABC, 5)) for ids in members}
    assert len(first) == 1
    later = {ids.assign(Result(2, ABC, 9)) for ids in members}  # the same quorum, steps later: the same process group
    assert later == first


def test_a_restarted_lighthouse_never_repeats_an_id_of_another_membership() -> None:
    """What the groups saw in a real run (tests/replica/test_replica_lighthouse_e2e.py, before the ids were made
    unique): lighthouse ids 1 (two groups) and 2 (three), then after the restart 1 (two groups), 2 (three)."""
    ids = QuorumIds()
    seen = [
        ids.assign(Result(1, ABC[:2], 0)),
        ids.assign(Result(2, ABC, 3)),
        ids.assign(Result(1, ABC[1:], 10)),  # restarted: its id 1 again, other members
        ids.assign(Result(2, ABC, 10)),  # its id 2 again, the members of the old 2: must still be new
    ]
    assert len(set(seen)) == 4
    assert all(0 < i < 2**62 for i in seen)
    # The lighthouse's id raised for the same members (a failed commit): a new process group, a new id.
    assert ids.assign(Result(3, ABC, 10)) not in seen
    # Another process in a member's place (a new uuid): a new id.
    assert ids.assign(Result(3, ["0:a", "1:b", "2:z"], 10)) not in seen


def test_the_id_is_written_into_the_result_torchft_reads() -> None:
    result = Result(1, ABC, 0)
    assigned = QuorumIds().assign(result)
    assert result.quorum_id == assigned != 1


# ------------------------------------------------------------------------------------------------ settings


def test_lighthouse_wait_is_a_positive_timedelta_named_in_the_error() -> None:
    assert ReplicaGroups().lighthouse_wait == timedelta(minutes=5)
    config = ReplicaGroups(lighthouse="http://h:1", replica_id="0", lighthouse_wait=timedelta(seconds=30)).resolved()
    assert config.lighthouse_wait == timedelta(seconds=30)
    with pytest.raises(TypeError, match=r"ReplicaGroups\(lighthouse_wait=30\): must be a datetime.timedelta"):
        ReplicaGroups(lighthouse_wait=30)
    with pytest.raises(ValueError, match=r"ReplicaGroups\(lighthouse_wait=datetime.timedelta\(0\)\): must be positive"):
        ReplicaGroups(lighthouse_wait=timedelta(0))


def test_the_manager_retries_quorum_requests_for_as_long_as_the_groups_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import TCPStore

    from lightning_ft.replica.heal_transport import HealTransport
    from lightning_ft.replica.lighthouse_watch import quorum_request_timeout
    from lightning_ft.replica.replica_sync import replica_manager

    monkeypatch.setenv("TORCHFT_QUORUM_RETRIES", "0")  # torchft's variable would turn the retries off
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    with lighthouse() as address:
        config = ReplicaGroups(lighthouse=address, replica_id="0", address="127.0.0.1").resolved()
        transport = HealTransport(address="127.0.0.1", timeout=config.timeout)
        with pytest.warns(UserWarning, match="TORCHFT_QUORUM_RETRIES=0 ignored"):
            manager = replica_manager(config, group_rank=0, group_world_size=1, transport=transport)
        try:
            retries = _compat.manager_quorum_retries(manager)
        finally:
            manager.shutdown(wait=False)
    # One retry every 0.25 s at most (torchft sleeps the deadline / (retries + 1) between them) for the whole deadline
    # of a request, which outlasts the quorum timeout plus lighthouse_wait.
    deadline = quorum_request_timeout(config, first=True)
    assert deadline >= config.first_quorum_timeout + config.lighthouse_wait
    assert deadline.total_seconds() / (retries + 1) <= 0.25


# ------------------------------------------------------------------------------------------------ a restart, for real


@pytest.mark.timeout(240)
@pytest.mark.parametrize("unique_ids", [True, False], ids=["unique ids", "the lighthouse's ids (ablation)"])
def test_a_group_alone_after_a_lighthouse_restart_rebuilds_its_process_group(unique_ids: bool) -> None:
    """Two groups (torchft Managers in this process) commit a step together in the lighthouse's quorum 1; the
    lighthouse restarts at the same address, and group A's next quorum is its first one: id 1 again, with A alone
    (B heartbeats but does not join within the join timeout). With the lighthouse's ids torchft keeps A's process group
    of two (the id did not change) and A's all-reduce waits for B until it times out: the step is discarded. With
    :class:`QuorumIds` the id is new, A's process group is rebuilt for one, and the step commits."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    port = free_port()

    def serve() -> LighthouseServer:
        deadline = time.monotonic() + 30
        while True:  # the killed server's socket is released asynchronously
            try:
                return LighthouseServer(
                    bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=1000
                )
            except RuntimeError:
                assert time.monotonic() < deadline
                time.sleep(0.2)

    server = serve()
    stores, managers = [], {}
    try:
        for name in ("A", "B"):
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            stores.append(store)
            managers[name] = Manager(
                pg=ProcessGroupGloo(timeout=timedelta(seconds=3)),
                load_state_dict=None,
                state_dict=None,
                min_replica_size=1,
                use_async_quorum=False,
                replica_id=name,
                rank=0,
                world_size=1,
                store_addr="127.0.0.1",
                store_port=store.port,
                lighthouse_addr=f"http://127.0.0.1:{port}",
                hostname="127.0.0.1",
                timeout=timedelta(seconds=3),
                quorum_timeout=timedelta(seconds=60),
                connect_timeout=timedelta(seconds=10),
                heartbeat_interval=timedelta(milliseconds=100),
                quorum_retries=400,
                init_sync=False,
            )
            if unique_ids:  # what ReplicaSync installs
                _compat.quorum_recorder_patch(managers[name], QuorumIds().assign).install()

        def step(manager: Manager) -> bool:
            manager.start_quorum()
            manager.allreduce(torch.ones(4)).wait()
            return bool(manager.should_commit())

        both = [threading.Thread(target=lambda m=m: results.append(step(m))) for m in managers.values()]
        results: list[bool] = []
        for thread in both:
            thread.start()
        for thread in both:
            thread.join(timeout=120)
        assert results == [True, True] and managers["A"].num_participants() == 2

        server.shutdown()  # the lighthouse dies and comes back at the same address, knowing nothing
        server = serve()
        committed = step(managers["A"])
        assert managers["A"].num_participants() == 1  # A alone in the restarted lighthouse's first quorum
        assert committed is unique_ids, "the step of the group alone" + (" was discarded" if unique_ids else "")
    finally:
        for manager in managers.values():
            manager.shutdown(wait=False)
        server.shutdown()
