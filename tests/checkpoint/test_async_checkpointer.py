"""AsyncCheckpointer in one process: consistency, error surfacing, one save in flight, replacing a checkpoint."""

from __future__ import annotations

import contextlib
import errno
import threading

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from lightning_ft.checkpoint import AsyncCheckpointer, load_checkpoint, verify
from lightning_ft.checkpoint import snapshot_storage as storage_module
from lightning_ft.checkpoint.async_checkpointer import THREAD_NAME
from lightning_ft.checkpoint.internal import is_committed, read_metadata
from tests.checkpoint.support import FlakyStorage, GatedStorage, enospc, folders_only

pytestmark = pytest.mark.usefixtures("checkpoint_format")  # each test runs against every format


def test_tensors_mutated_in_place_after_save_returns_do_not_reach_the_checkpoint(tmp_path):
    weight, bias = torch.randn(64, 32), torch.randn(32)
    expected = {"weight": weight.clone(), "bias": bias.clone()}
    state = {"model": {"weight": weight, "bias": bias}, "loops": {"epoch": 1}}
    storage = GatedStorage()
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(tmp_path / "step=1", state, metadata={"step": 1})
        storage.started.wait()
        # The write is held back until the caller has changed everything it passed.
        weight.mul_(3).add_(1)
        bias.zero_()
        state["loops"]["epoch"] = 99
        storage.gate.set()
    finally:
        checkpointer.close()
    template = {"model": {"weight": torch.zeros(64, 32), "bias": torch.zeros(32)}}
    loaded = load_checkpoint(tmp_path / "step=1", template)
    assert torch.equal(template["model"]["weight"], expected["weight"])
    assert torch.equal(template["model"]["bias"], expected["bias"])
    assert loaded.state["loops"]["epoch"] == 1
    assert loaded.state["model"]["weight"] is template["model"]["weight"]


def test_save_returns_before_the_write_and_commits_in_a_named_background_thread(tmp_path):
    storage = GatedStorage()
    commits = []
    thread_names = []

    def on_commit(info):
        commits.append(info)
        thread_names.append(threading.current_thread().name)

    checkpointer = AsyncCheckpointer(storage=storage, on_commit=on_commit)
    try:
        checkpointer.save(tmp_path / "step=5", {"w": torch.ones(4)}, metadata={"step": 5})
        assert checkpointer.in_flight == tmp_path / "step=5"
        assert not is_committed(tmp_path / "step=5")
        storage.gate.set()
        checkpointer.wait()
        assert checkpointer.in_flight is None
    finally:
        checkpointer.close()
    assert is_committed(tmp_path / "step=5")
    assert thread_names == [THREAD_NAME]
    [info] = commits
    assert info.path == tmp_path / "step=5" and info.step == 5
    assert info.size_bytes == 16 and 0 <= info.stall_s <= info.total_s


def test_only_one_save_is_in_flight_and_the_next_save_waits_for_the_commit(tmp_path):
    folders_only()
    storage = GatedStorage()
    commits = []
    checkpointer = AsyncCheckpointer(storage=storage, on_commit=lambda info: commits.append(info.path.name))
    commits_seen_when_second_save_returned = []

    def second_save():
        checkpointer.save(tmp_path / "b", {"w": torch.zeros(2)})
        commits_seen_when_second_save_returned.extend(commits)

    try:
        checkpointer.save(tmp_path / "a", {"w": torch.ones(2)})
        storage.started.wait()
        saver = threading.Thread(target=second_save, name="test-second-save")
        saver.start()
        storage.gate.set()
        saver.join()
        checkpointer.wait()
    finally:
        checkpointer.close()
    assert commits_seen_when_second_save_returned == ["a"]
    assert storage.log == ["start a", "end a", "start b", "end b"]


def test_a_full_disk_surfaces_at_wait_and_leaves_the_previous_checkpoint_loadable(tmp_path):
    storage = FlakyStorage()
    commits = []
    checkpointer = AsyncCheckpointer(storage=storage, on_commit=commits.append)
    try:
        checkpointer.save(tmp_path / "step=1", {"w": torch.arange(6.0)}, metadata={"step": 1})
        checkpointer.wait()
        storage.failures.append(enospc())
        checkpointer.save(tmp_path / "step=2", {"w": torch.arange(6.0) + 1}, metadata={"step": 2})
        with pytest.raises(OSError) as raised:
            checkpointer.wait()
        assert raised.value.errno == errno.ENOSPC
        checkpointer.wait()  # raised once, not again
    finally:
        checkpointer.close()
    assert [c.step for c in commits] == [1]
    assert not is_committed(tmp_path / "step=2")
    assert verify(tmp_path / "step=1") == []
    assert torch.equal(load_checkpoint(tmp_path / "step=1").state["w"], torch.arange(6.0))


def test_a_background_failure_is_raised_by_the_next_save_which_then_writes_nothing(tmp_path):
    storage = FlakyStorage()
    storage.failures.append(enospc())
    checkpointer = AsyncCheckpointer(storage=storage)
    try:
        checkpointer.save(tmp_path / "step=1", {"w": torch.ones(2)})
        with pytest.raises(OSError) as raised:
            checkpointer.save(tmp_path / "step=2", {"w": torch.ones(2)})
        assert raised.value.errno == errno.ENOSPC
        assert not (tmp_path / "step=2").exists()
        checkpointer.save(tmp_path / "step=3", {"w": torch.ones(2)})
    finally:
        checkpointer.close()
    assert is_committed(tmp_path / "step=3")
    assert not is_committed(tmp_path / "step=1")


def test_close_raises_a_background_error_once_and_no_later_failure_comes_before_the_first(tmp_path):
    storage = FlakyStorage()
    storage.failures += [enospc(), OSError(errno.EIO, "Input/output error")]
    checkpointer = AsyncCheckpointer(storage=storage)
    checkpointer.save(tmp_path / "step=1", {"w": torch.ones(2)})
    # The first failure is raised before the next save starts anything, so that save cannot fail (with EIO) first.
    with pytest.raises(OSError) as raised:
        checkpointer.save(tmp_path / "step=2", {"w": torch.ones(2)})
    assert raised.value.errno == errno.ENOSPC
    assert [e.errno for e in storage.failures] == [errno.EIO]
    checkpointer.save(tmp_path / "step=3", {"w": torch.ones(2)})
    with pytest.raises(OSError) as raised:
        checkpointer.close()
    assert raised.value.errno == errno.EIO
    checkpointer.close()  # idempotent, and the error was raised once
    with pytest.raises(RuntimeError, match="after close"):
        checkpointer.save(tmp_path / "step=4", {"w": torch.ones(2)})
    assert not any(is_committed(tmp_path / f"step={n}") for n in (1, 2, 3))


def test_a_save_whose_commit_callback_fails_is_raised_at_the_next_save_and_not_committed(tmp_path):
    committed_when_called = []

    def on_commit(info):
        committed_when_called.append(is_committed(info.path))  # the callback runs once the marker is durable
        raise ValueError(f"event log full at {info.path.name}")

    checkpointer = AsyncCheckpointer(on_commit=on_commit)
    try:
        checkpointer.save(tmp_path / "step=1", {"w": torch.ones(2)})
        with pytest.raises(ValueError, match="step=1"):
            checkpointer.save(tmp_path / "step=2", {"w": torch.ones(2)})
    finally:
        checkpointer.close()
    assert committed_when_called == [True]
    assert not is_committed(tmp_path / "step=1")  # reported as failed, so not committed
    assert not (tmp_path / "step=1").exists() and not (tmp_path / "step=2").exists()


def test_a_disk_error_inside_the_format_library_is_raised_with_its_errno_and_nothing_is_committed(
    tmp_path, monkeypatch, checkpoint_format
):
    folders_only()
    if checkpoint_format == "torchsnapshot":

        def full_disk(self, write_io):
            raise enospc()

        monkeypatch.setattr(storage_module._DurableFSPlugin, "_write_sync", full_disk)
    else:
        real_stream = dcp_filesystem.FileSystem.create_stream

        @contextlib.contextmanager
        def full_disk(self, path, mode):
            if str(path).endswith(".distcp"):
                raise enospc()
            with real_stream(self, path, mode) as stream:
                yield stream

        monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", full_disk)
    checkpointer = AsyncCheckpointer()
    checkpointer.save(tmp_path / "step=1", {"w": torch.ones(1000)})
    with pytest.raises(OSError) as raised:
        checkpointer.close()
    assert raised.value.errno == errno.ENOSPC
    assert not is_committed(tmp_path / "step=1")


def test_rank_state_and_metadata_round_trip_in_one_process(tmp_path):
    np_state = np.random.RandomState(3).get_state()
    rank_state = {"torch": torch.get_rng_state(), "numpy": np_state}
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(
            tmp_path / "c",
            {"w": torch.ones(2)},
            rank_state=rank_state,
            metadata={"step": 7, "epoch": 2, "mesh_shape": (1, 1)},
        )
    finally:
        checkpointer.close()
    loaded = load_checkpoint(tmp_path / "c")
    assert loaded.saved_rank == 0
    assert torch.equal(loaded.rank_state["torch"], rank_state["torch"])
    assert np.array_equal(loaded.rank_state["numpy"][1], np_state[1])
    assert loaded.metadata["step"] == 7 and loaded.metadata["world_size"] == 1
    assert loaded.metadata["format_version"] == 1
    assert read_metadata(tmp_path / "c")["mesh_shape"] == (1, 1)


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "c", {"w": torch.ones(3)}, metadata={"step": 1})
        checkpointer.save(tmp_path / "c", {"w": torch.zeros(3)}, metadata={"step": 2})
    finally:
        checkpointer.close()
    loaded = load_checkpoint(tmp_path / "c")
    assert loaded.metadata["step"] == 2 and torch.equal(loaded.state["w"], torch.zeros(3))


def test_bfloat16_bool_and_scalar_tensors_round_trip_bitwise(tmp_path):
    state = {"bf16": torch.randn(5, 3).to(torch.bfloat16), "mask": torch.rand(7) > 0.5, "step": torch.tensor(4.0)}
    checkpointer = AsyncCheckpointer()
    try:
        checkpointer.save(tmp_path / "c", state)
    finally:
        checkpointer.close()
    loaded = load_checkpoint(tmp_path / "c").state
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)
