"""``ReplicaGroups(timeout=...)`` is the one timeout setting: torchft's own environment variables for its timeouts
(which torchft's Manager would let win over what it is passed) are ignored with a warning that names both."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lightning_ft import ReplicaGroups, _compat
from lightning_ft.replica.heal_transport import HealTransport
from lightning_ft.replica.replica_sync import replica_manager
from tests.replica._lighthouse import lighthouse

pytest.importorskip("torchft")


def _manager_timeouts(address: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, timedelta]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    config = ReplicaGroups(
        lighthouse=address, replica_id="0", timeout=timedelta(seconds=2), address="127.0.0.1"
    ).resolved()
    transport = HealTransport(address="127.0.0.1", timeout=config.timeout)
    manager = replica_manager(config, group_rank=0, group_world_size=1, transport=transport)
    try:
        return _compat.manager_timeouts(manager)
    finally:
        manager.shutdown(wait=False)


def test_replica_groups_timeout_wins_over_torchfts_variables_with_a_warning_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "600")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "900")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "300")
    with lighthouse() as address:
        with pytest.warns(UserWarning) as warned:
            timeouts = _manager_timeouts(address, monkeypatch)
    assert timeouts == {
        "timeout": timedelta(seconds=2),
        "quorum_timeout": timedelta(seconds=24),  # 12 x timeout
        "connect_timeout": timedelta(seconds=10),  # timeout, at least 10 s
    }
    message = " ".join(str(w.message) for w in warned)
    for said in ("TORCHFT_TIMEOUT_SEC=600", "TORCHFT_QUORUM_TIMEOUT_SEC=900", "TORCHFT_CONNECT_TIMEOUT_SEC=300"):
        assert said in message, message
    assert "ReplicaGroups(timeout=datetime.timedelta(seconds=2))" in message, message
    # The variables are the user's: still set after set-up.
    import os

    assert os.environ["TORCHFT_TIMEOUT_SEC"] == "600"


def test_without_torchfts_variables_nothing_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    for name in ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC"):
        monkeypatch.delenv(name, raising=False)
    with lighthouse() as address, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _manager_timeouts(address, monkeypatch)["timeout"] == timedelta(seconds=2)
