"""The heal transport: binds the address it advertises, serves the state as it was when handed over, and reads what
it receives through the restricted unpickler."""

from __future__ import annotations

import urllib.error
import warnings
from datetime import timedelta

import pytest
import torch

from lightning_ft.checkpoint import UnsafeCheckpointError

pytest.importorskip("torchft")

from lightning_ft.replica.heal_transport import HealTransport  # noqa: E402


class NotAllowed:
    """A class torch's restricted unpickler does not admit."""


@pytest.fixture
def transport():
    server = HealTransport(address="127.0.0.1", timeout=timedelta(seconds=2))
    yield server
    server.shutdown()


def test_it_binds_and_advertises_the_given_address(transport: HealTransport) -> None:
    assert transport._server.server_address[0] == "127.0.0.1"
    assert transport.metadata().startswith("http://127.0.0.1:")


def test_a_joining_group_receives_the_state_as_it_was_handed_over(transport: HealTransport) -> None:
    weights = torch.arange(6.0)
    transport.send_checkpoint([1], step=7, state_dict={"user": {"w": weights}, "step": 7}, timeout=timedelta(seconds=2))
    weights.add_(100)  # the training loop goes on after the hand-over
    received = transport.recv_checkpoint(0, transport.metadata(), step=7, timeout=timedelta(seconds=2))
    assert torch.equal(received["user"]["w"], torch.arange(6.0)) and received["step"] == 7
    size, seconds = transport.last_received
    assert size > 0 and seconds >= 0


def test_a_state_that_needs_an_unsafe_class_is_refused(transport: HealTransport) -> None:
    with warnings.catch_warnings():  # the sender warns once per process and payload type, whichever test sends first
        warnings.simplefilter("ignore")
        transport.send_checkpoint([1], step=1, state_dict={"obj": NotAllowed()}, timeout=timedelta(seconds=2))
    with pytest.raises(UnsafeCheckpointError):
        transport.recv_checkpoint(0, transport.metadata(), step=1, timeout=timedelta(seconds=2))


def test_no_state_is_served_after_the_commit_vote_or_for_another_step(transport: HealTransport) -> None:
    transport.send_checkpoint([1], step=3, state_dict={"x": 1}, timeout=timedelta(seconds=2))
    with pytest.raises(urllib.error.HTTPError, match="409"):
        transport.recv_checkpoint(0, transport.metadata(), step=2, timeout=timedelta(seconds=2))
    transport.disallow_checkpoint()
    with pytest.raises(urllib.error.HTTPError, match="409"):
        transport.recv_checkpoint(0, transport.metadata(), step=3, timeout=timedelta(seconds=5))
