"""CUDA tensors are staged into pinned host buffers before ``save()`` returns, and those buffers are reused.

The copy is non-blocking, so the save call must wait for it: otherwise the background writer could read a pinned
buffer the copy has not reached yet (the previous save's bytes), and a write on another stream right after the call
could land in the checkpoint. Each test skips without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint
from lightning_ft.checkpoint.ownership import regions_to_write
from lightning_ft.checkpoint.staging import Stager, encode_state

pytestmark = pytest.mark.gpu


def _keep_the_stream_busy() -> None:
    """Queue a few hundred milliseconds of kernels on the current stream, so what is queued next runs late."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        a = torch.tanh(a @ a)


def test_a_cuda_tensor_written_right_after_save_returns_is_saved_as_it_was_at_the_call(tmp_path):
    weight = torch.zeros(64 << 20, device="cuda")  # 256 MB
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "first", {"w": weight})  # its pinned buffer now holds zeros
        checkpointer.wait()
        _keep_the_stream_busy()
        weight.fill_(2.0)  # queued behind the busy kernels: the state the next save is called with
        checkpointer.save(tmp_path / "second", {"w": weight})
        with torch.cuda.stream(torch.cuda.Stream()):
            weight.fill_(3.0)  # another stream, right after the call: must not reach the checkpoint
        checkpointer.wait()
    finally:
        checkpointer.close()
    saved = load_checkpoint(tmp_path / "second").state["w"]
    assert bool((saved == 2.0).all()), f"values saved: {saved.unique().tolist()}"
    assert bool((load_checkpoint(tmp_path / "first").state["w"] == 0.0).all())


def test_cuda_tensors_are_staged_into_pinned_buffers_that_the_next_save_reuses():
    stager = Stager()
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(16, device="cuda")}

    def capture():
        encoded = encode_state(state, None, rank=0)
        return stager.capture(encoded, regions_to_write(encoded.shared, rank=0, world_size=1, group=None))

    first = {s.key: s.data for s in capture().shards}
    state["w"].mul_(2)
    second = {s.key: s.data for s in capture().shards}
    assert all(buf.is_pinned() and buf.device.type == "cpu" for buf in second.values())
    assert {k: b.data_ptr() for k, b in first.items()} == {k: b.data_ptr() for k, b in second.items()}
    assert torch.equal(second["w"], state["w"].cpu())


def test_a_checkpoint_of_cuda_tensors_loads_into_a_cuda_template_in_place(tmp_path):
    weight = torch.randn(1000, 3, device="cuda")
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "c", {"w": weight})
        checkpointer.wait()
    finally:
        checkpointer.close()
    template = {"w": torch.zeros(1000, 3, device="cuda")}
    target = template["w"]
    load_checkpoint(tmp_path / "c", template)
    assert target.device.type == "cuda" and torch.equal(target, weight)
