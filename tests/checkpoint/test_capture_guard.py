"""Deferred capture: the save call returns before parameters and optimizer state are copied, and still the checkpoint
holds exactly the state of the save call, or the save fails loudly."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, CaptureGuard, CaptureRaceError, load_checkpoint
from lightning_ft.checkpoint.async_checkpointer import THREAD_NAME
from lightning_ft.checkpoint.internal import is_committed
from lightning_ft.checkpoint.staging import Stager


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    optimizer.step()


def _state(model, optimizer):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _snapshot(model, optimizer):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": [s["exp_avg"].clone() for s in optimizer.state.values()],
    }


@pytest.fixture
def gated_copies(monkeypatch):
    """Holds every deferred copy until the test opens the gate, so a write can be placed before it for sure."""
    gate = threading.Event()
    finish = Stager.finish

    def gated(capture):
        assert gate.wait(timeout=60)
        finish(capture)

    monkeypatch.setattr(Stager, "finish", staticmethod(gated))
    yield gate
    gate.set()


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _train_step(model, optimizer)  # optimizer state exists
    guard = CaptureGuard()
    guard.watch(modules=[model], optimizers=[optimizer])
    checkpointer = AsyncCheckpointer(capture_guard=guard)
    yield model, optimizer, guard, checkpointer
    try:
        checkpointer.close()
    except CaptureRaceError:
        pass
    guard.close()


def test_the_next_optimizer_step_waits_for_the_deferred_copy_so_the_checkpoint_holds_the_saved_state(
    tmp_path, setup, gated_copies
):
    model, optimizer, _, checkpointer = setup
    before = _snapshot(model, optimizer)
    checkpointer.save(tmp_path / "ckpt", _state(model, optimizer), metadata={"step": 1})
    # The copies have not started; the forward and backward of the next step run beside them.
    opener = threading.Timer(0.2, gated_copies.set)
    opener.start()
    _train_step(model, optimizer)  # its optimizer.step() blocks until the gate opens and the copies are done
    opener.join()
    checkpointer.wait()  # a step that did not wait would have moved the version counters: CaptureRaceError here
    assert not torch.equal(model.linear.weight, before["model"]["linear.weight"])  # training went on

    template = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    template = {
        "model": {k: torch.zeros_like(v) for k, v in template["model"].items()},
        "optimizer": template["optimizer"],
    }
    loaded = load_checkpoint(tmp_path / "ckpt", template).state
    for key, value in before["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    exp_avg = [s["exp_avg"] for s in loaded["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, before["exp_avg"], strict=True))


def test_buffers_changed_by_the_next_forward_are_saved_as_they_were_at_the_save_call(tmp_path, setup, gated_copies):
    model, optimizer, _, checkpointer = setup
    running_mean = model.norm.running_mean.clone()
    checkpointer.save(tmp_path / "ckpt", _state(model, optimizer), metadata={"step": 1})
    model(torch.randn(16, 8) + 5.0)  # BatchNorm statistics move in forward, while the weights' copies wait
    assert not torch.equal(model.norm.running_mean, running_mean)
    gated_copies.set()
    checkpointer.wait()
    template = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    loaded = load_checkpoint(tmp_path / "ckpt", {"model": template}).state
    assert torch.equal(loaded["model"]["norm.running_mean"], running_mean)


def test_a_weight_written_between_the_save_call_and_its_copy_fails_the_save_instead_of_mixing_states(
    tmp_path, setup, gated_copies
):
    model, optimizer, _, checkpointer = setup
    checkpointer.save(tmp_path / "ckpt", _state(model, optimizer), metadata={"step": 1})
    with torch.no_grad():
        model.linear.weight.mul_(0.5)  # a callback writing weights outside optimizer.step()
    gated_copies.set()
    with pytest.raises(CaptureRaceError, match="linear.weight"):
        checkpointer.wait()
    assert not is_committed(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # nothing was written for it


def test_without_a_guard_everything_is_copied_before_save_returns(tmp_path, gated_copies):
    weight = torch.ones(4)
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "ckpt", {"w": weight}, metadata={"step": 1})
        weight.add_(1)  # no deferred copy exists: the gate is never consulted
        checkpointer.wait()
    finally:
        checkpointer.close()
    assert torch.equal(load_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(4)}).state["w"], torch.ones(4))


def test_a_closed_guard_no_longer_holds_optimizer_steps(setup):
    model, optimizer, guard, _ = setup
    guard.begin()  # as if a capture were in flight
    guard.close()
    _train_step(model, optimizer)  # would block forever with the hook still installed


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread nice values are a Linux feature")
def test_the_background_writer_runs_at_a_lower_priority_than_training(tmp_path):
    checkpointer = AsyncCheckpointer(writer_niceness=3)
    try:
        checkpointer.save(tmp_path / "ckpt", {"w": torch.ones(4)}, metadata={"step": 1})
        checkpointer.wait()
        [writer] = [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]
        ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, ours + 3)
    finally:
        checkpointer.close()


def test_a_negative_writer_niceness_is_refused():
    with pytest.raises(ValueError, match="writer_niceness=-1"):
        AsyncCheckpointer(writer_niceness=-1)
