"""The single-file format: Lightning's own file plus our record, committed by a rename, owned without unpickling."""

from __future__ import annotations

import os
import signal
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_ft.checkpoint import (
    AsyncCheckpointer,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    cleanup_uncommitted,
    list_committed,
    load_checkpoint,
    recover_interrupted_swaps,
    verify,
)
from lightning_ft.checkpoint.internal import Retention, describe, export_state_dict, format_choice, resolve_format
from lightning_ft.checkpoint.single_file import (
    RECORD_KEY,
    FileStorage,
    is_checkpoint_file,
    read_file_document,
    read_marker,
)
from lightning_ft.checkpoint.snapshot_storage import SnapshotStorage
from tests.checkpoint.support import CreatesFileWhenUnpickled, in_forked_child, kill_this_process


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {
        "state_dict": {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4), "steps": torch.tensor(step)},
        "optimizer_states": [
            {"state": {0: {"exp_avg": torch.randn(4, 3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
        ],
        "epoch": 1,
        "global_step": step,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
        "hyper_parameters": {"name": "hello-marker-neighbour", "width": 4},
        "empty": torch.empty(0, 5),
    }


def _rank_state(step: int) -> dict:
    return {"callbacks": {"Cb": {"best": torch.tensor(float(step)), "seen": [1, 2]}}, "rng": {"torch": torch.arange(8)}}


def save_file(path, step: int, *, storage=None, on_commit=None, state=None):
    checkpointer = AsyncCheckpointer(storage=storage or FileStorage(), on_commit=on_commit)
    try:
        checkpointer.save(
            path,
            state or _state(step),
            rank_state=_rank_state(step),
            metadata={"step": step, "full_state": True, "run_id": "r1"},
        )
    finally:
        checkpointer.close()
    return path


def _assert_equal(expected, actual, where=""):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert expected.shape == actual.shape, where
        assert torch.equal(expected.reshape(-1).view(torch.uint8), actual.reshape(-1).view(torch.uint8)), where
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), where
        for k in expected:
            _assert_equal(expected[k], actual[k], f"{where}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_equal(e, a, f"{where}/{i}")
    else:
        assert expected == actual, where


def test_a_checkpoint_file_is_the_file_lightning_writes_plus_our_record_and_loads_bitwise_both_ways(tmp_path):
    path = save_file(tmp_path / "epoch=1-step=7.ckpt", 7)
    assert os.path.isfile(path) and is_checkpoint_file(path)
    plain = torch.load(path, weights_only=True)  # what Lightning's own readers do
    record = plain.pop(RECORD_KEY)
    _assert_equal({**_state(7), "callbacks": _rank_state(7)["callbacks"]}, plain)
    assert isinstance(record["marker"], str) and isinstance(record["document"], str)
    assert all(isinstance(t, torch.Tensor) for t in record["entries"].values())
    loaded = load_checkpoint(path)  # lightning-ft's own load: the path a folder loads through
    _assert_equal(_state(7), loaded.state)
    _assert_equal(_rank_state(7), loaded.rank_state)
    assert loaded.metadata["step"] == 7 and loaded.metadata["world_size"] == 1
    marker = read_marker(path)
    assert marker["step"] == 7 and marker["full_state"] is True and marker["run_id"] == "r1"
    assert [(c.path.name, c.step, c.full_state) for c in list_committed(tmp_path)] == [(path.name, 7, True)]
    assert verify(path) == [] and describe(path)["committed"] and describe(path)["step"] == 7
    out = export_state_dict(path, tmp_path / "model.pt")
    assert torch.equal(
        torch.load(out, weights_only=True)["state_dict"]["layer.bias"], _state(7)["state_dict"]["layer.bias"]
    )


def test_the_tensor_bytes_are_stored_once(tmp_path):
    big = {"state_dict": {"w": torch.randn(256, 1024)}, "global_step": 1}  # 1 MiB
    path = save_file(tmp_path / "big.ckpt", 1, state=big)
    assert path.stat().st_size < 1.2 * 2**20


def test_ownership_is_proven_without_executing_the_pickle(tmp_path):
    lightning_file = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 3, "loops": {}}, lightning_file)
    assert not is_checkpoint_file(lightning_file) and read_marker(lightning_file) is None
    sentinel = tmp_path / "unpickled"
    ours = save_file(tmp_path / "ours.ckpt", 1)
    # A file with our marker and a payload that would run code when unpickled: scanning it runs nothing.
    evil = tmp_path / "evil.ckpt"
    torch.save(
        {"x": CreatesFileWhenUnpickled(sentinel), RECORD_KEY: torch.load(ours, weights_only=True)[RECORD_KEY]}, evil
    )
    assert is_checkpoint_file(evil) and read_marker(evil)["step"] == 1
    read_file_document(evil)
    assert list_committed(tmp_path)  # listing reads markers only
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(evil)
    assert not sentinel.exists()
    assert not is_checkpoint_file(tmp_path / "missing.ckpt")
    (tmp_path / "text.ckpt").write_text("not a zip")
    assert not is_checkpoint_file(tmp_path / "text.ckpt")


def _flip(path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_flipped_byte_in_a_tensor_is_refused_at_load_and_named_by_verify(tmp_path):
    state = _state(5)
    path = save_file(tmp_path / "c.ckpt", 5, state=state)
    wanted = state["state_dict"]["layer.weight"].contiguous().view(torch.uint8).numpy().tobytes()
    at = path.read_bytes().find(wanted)
    assert at > 0
    _flip(path, at + 5)
    assert torch.load(path, weights_only=True)["global_step"] == 5  # torch.load checks no checksum
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch.*layer.weight"):
        load_checkpoint(path)
    assert any("layer.weight" in p for p in verify(path))


def _pickle_offset(path) -> int:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    header = path.read_bytes()[info.header_offset : info.header_offset + 30]
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def test_a_flipped_byte_in_the_pickled_state_is_refused_at_load(tmp_path):
    path = save_file(tmp_path / "c.ckpt", 5)
    start = _pickle_offset(path)
    at = path.read_bytes().find(b"hello-marker-neighbour", start)
    assert at > start
    _flip(path, at + 2)  # a hyper-parameter Lightning's readers would see changed, not one of our tensors
    assert is_checkpoint_file(path)  # still proven ours: retention and listing see it
    with pytest.raises(CorruptCheckpointError, match="CRC32"):
        load_checkpoint(path)
    assert verify(path)


def test_a_file_replaces_a_file_a_folder_replaces_a_file_and_a_file_replaces_a_folder(tmp_path):
    path = tmp_path / "latest.ckpt"
    save_file(path, 1)
    save_file(path, 2)
    assert path.is_file() and load_checkpoint(path).metadata["step"] == 2
    folder_writer = AsyncCheckpointer(storage=SnapshotStorage())
    try:
        folder_writer.save(path, _state(3), metadata={"step": 3})  # a run on more processes, at the same path
    finally:
        folder_writer.close()
    assert path.is_dir() and load_checkpoint(path).metadata["step"] == 3
    save_file(path, 4)
    assert path.is_file() and load_checkpoint(path).metadata["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.ckpt"]


def test_a_save_whose_commit_callback_fails_is_undone_and_the_file_it_replaced_comes_back(tmp_path):
    path = save_file(tmp_path / "c.ckpt", 1)
    before = path.read_bytes()

    def fail(info):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        save_file(path, 2, on_commit=fail)
    assert path.read_bytes() == before and load_checkpoint(path).metadata["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


class DyingFileStorage(FileStorage):
    """Writes half of the checkpoint file, then the process is killed: a save interrupted mid-write."""

    def write(self, path, entries, *, group, document=None):
        super().write(path, entries, group=group, document=document)
        staged = next(path.glob("*.ckpt"))
        data = staged.read_bytes()
        staged.write_bytes(data[: len(data) // 2])
        kill_this_process()


def test_a_save_killed_mid_write_leaves_the_previous_file_committed_and_a_leftover_of_ours_that_cleanup_removes(
    tmp_path,
):
    path = save_file(tmp_path / "last.ckpt", 1)
    before = path.read_bytes()
    status = in_forked_child(lambda: save_file(path, 2, storage=DyingFileStorage()))
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert path.read_bytes() == before and load_checkpoint(path).metadata["step"] == 1
    [leftover] = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert leftover.is_dir() and [c.path for c in list_committed(tmp_path)] == [path]
    cleanup_uncommitted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("killed_after", ["link", "replace"])
def test_a_kill_between_the_steps_of_a_replacement_leaves_a_committed_file_that_recovery_tidies(
    tmp_path, monkeypatch, killed_after
):
    path = save_file(tmp_path / "c.ckpt", 1)
    import lightning_ft.checkpoint.file_commit as file_commit

    def killing(real):
        def call(*args):
            real(*args)
            kill_this_process()

        return call

    def kill_during_save():
        if killed_after == "link":  # the old file has its second name beside it, the new one is not in place
            monkeypatch.setattr(file_commit.os, "link", killing(os.link))
        else:  # the new file is in place; the old one's second name and the staging folder are left
            monkeypatch.setattr(file_commit.FileSwap, "swap", killing(file_commit.FileSwap.swap))
        save_file(path, 2)

    status = in_forked_child(kill_during_save)
    assert os.WIFSIGNALED(status)
    expected = 1 if killed_after == "link" else 2
    assert load_checkpoint(path).metadata["step"] == expected
    recover_interrupted_swaps(tmp_path)
    cleanup_uncommitted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert load_checkpoint(path).metadata["step"] == expected


def test_retention_deletes_a_file_of_ours_and_never_a_foreign_lightning_file(tmp_path):
    foreign = tmp_path / "epoch=0-step=1.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, foreign)
    ours = save_file(tmp_path / "epoch=0-step=2.ckpt", 2)
    save_file(tmp_path / "epoch=0-step=3.ckpt", 3)
    retention = Retention(in_flight=lambda: None)
    retention.remove(foreign)
    retention.remove(ours)
    assert foreign.read_bytes() and not ours.exists()
    assert [c.step for c in list_committed(tmp_path)] == [3]


def test_a_save_over_a_foreign_file_fails_and_leaves_it_alone(tmp_path):
    foreign = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, foreign)
    before = foreign.read_bytes()
    with pytest.raises(Exception, match="cannot save to"):
        save_file(foreign, 1)
    assert foreign.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_the_file_format_is_for_plain_state_and_auto_picks_it_for_plain_state_only():
    assert resolve_format("file", plain=True) == "file"
    assert resolve_format("auto", plain=True) == "file"  # any process count: every rank writes its share
    assert resolve_format("auto", plain=False) == "torchsnapshot"  # DTensor or pipeline state: folders
    assert resolve_format("torchsnapshot", plain=True) == "torchsnapshot"
    assert resolve_format("dcp", plain=False) == "dcp"
    with pytest.raises(ValueError, match=r"ElasticFT3D\(checkpoint_format='file'\):.*DTensor or pipeline"):
        resolve_format("file", plain=False)


def test_the_format_said_at_set_up_names_the_format_and_why():
    two = format_choice("auto", plain=True, world_size=2)
    assert "torch.save files" in two and "written by all 2 ranks in parallel" in two and "data-parallel state" in two
    assert "in parallel" not in format_choice("auto", plain=True, world_size=1)
    sharded = format_choice("auto", plain=False, world_size=4)
    assert "torchsnapshot folders" in sharded and "DTensor or pipeline state" in sharded
    assert format_choice("torchsnapshot", plain=True, world_size=2).endswith("(checkpoint_format='torchsnapshot')")
    assert "object-store URL" in format_choice("auto", plain=True, world_size=2, remote=True)
    # The strategy's reason (the tensor that keeps a run on folders, from its state) replaces the generic one.
    named = format_choice(
        "auto", plain=False, world_size=2, why="'head.weight' is a DTensor with placements (Shard(1))"
    )
    assert named.endswith("(checkpoint_format='auto': 'head.weight' is a DTensor with placements (Shard(1)))"), named
    assert "torchsnapshot folders" in named


def test_writing_a_checkpoint_file_holds_no_second_copy_of_the_state_in_memory(tmp_path, monkeypatch):
    # A save already holds one copy (the staged one); serializing the file into memory before writing it, as
    # Lightning's TorchCheckpointIO does, would add two more for the length of the write.
    import tracemalloc

    state = _state(5)
    state["state_dict"]["big"] = torch.randn(4 * 1024 * 1024)  # 16 MiB
    peaks = []
    write = FileStorage.write

    def traced_write(self, *args, **kwargs):
        tracemalloc.start()
        try:
            write(self, *args, **kwargs)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    monkeypatch.setattr(FileStorage, "write", traced_write)
    path = save_file(tmp_path / "big.ckpt", 5, state=state)
    assert is_checkpoint_file(path)
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["big"], state["state_dict"]["big"])
    assert peaks and peaks[0] < 4 * 1024 * 1024, f"the write allocated {peaks[0]} bytes for a 16 MiB state"


def test_a_version_1_file_written_by_the_previous_release_still_loads(tmp_path):
    # Written by lightning-ft at ad41c81 (file format 1: the record kept a second copy of the state as JSON).
    path = tmp_path / "epoch=0-step=3.ckpt"
    path.write_bytes((Path(__file__).parent / "data" / "format-1-step=3.ckpt").read_bytes())
    assert read_marker(path)["lightning_ft_file"] == 1
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.state["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded.state["hyper_parameters"] == {"lr": 0.25} and loaded.metadata["step"] == 3
    assert loaded.rank_state["callbacks"] == {"Cb": {"seen": 3}}
    assert torch.equal(loaded.rank_state["rng"]["torch"], torch.arange(8, dtype=torch.uint8))
    assert verify(path) == []


def test_the_record_holds_no_second_copy_of_lightnings_content(tmp_path):
    path = save_file(tmp_path / "c.ckpt", 4)
    record = torch.load(path, weights_only=True)[RECORD_KEY]
    assert read_marker(path)["lightning_ft_file"] == 2
    # Only the per-process state Lightning does not keep: the RNG states, not the model, optimizer or callbacks.
    assert set(record["entries"]) == {"rank_state/0/rng/torch"}
    document = record["document"]
    assert "hello-marker-neighbour" not in document and '"callbacks"' not in document
