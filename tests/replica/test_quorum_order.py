"""The replica ranks of a real torchft quorum index the bare ids in the quorum's own order (the heal's ``source``, the
cross-group exchange's slots and the data deal's ``group_index`` all read it so), which is not the sorted order of the
bare ids: ids 1 and 10."""

from __future__ import annotations

import threading
from datetime import timedelta

from lightning_ft.replica.replica_sync import members_by_rank
from tests.replica._lighthouse import lighthouse


def test_a_replica_rank_names_its_group_through_members_by_rank_even_where_sorted_ids_disagree() -> None:
    from torchft.coordination import ManagerClient, ManagerServer

    ids = ["1", "10"]
    results = {}
    with lighthouse(min_replicas=2, join_timeout_ms=200) as address:
        servers = {
            rid: ManagerServer(
                replica_id=f"{rid}:{rid}-uuid",
                lighthouse_addr=address,
                hostname="127.0.0.1",
                bind="127.0.0.1:0",
                store_addr="127.0.0.1:1",
                world_size=1,
                heartbeat_interval=timedelta(milliseconds=100),
                connect_timeout=timedelta(seconds=30),
                quorum_retries=0,
            )
            for rid in ids
        }

        def join(rid: str) -> None:
            client = ManagerClient(servers[rid].address(), connect_timeout=timedelta(seconds=30))
            # torchft 0.2.0's client call that torchft's Manager makes for its quorum (the test drives it directly).
            results[rid] = client._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=60),
                commit_failures=0,
                init_sync=True,
            )

        threads = [threading.Thread(target=join, args=(rid,)) for rid in ids]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=90)
        finally:
            for server in servers.values():
                server.shutdown()
    assert sorted(results) == ids
    for rid, result in results.items():
        assert members_by_rank(result.replica_ids)[result.replica_rank] == rid
    # the case that made sorting wrong: torchft's order is not the bare ids' sorted order
    assert members_by_rank(results["1"].replica_ids) != sorted(ids)
